"""The tiny task's reward, except that it hangs while the file named by ``TITANRL_TEST_STALL`` exists (a grader
that stops answering, for the SIGTERM tests); without that variable, or the file, it is the default reward."""

import os
import time

from titanrl.rl.rewards import exact_match_with_format


def reward(response, record):
    marker = os.environ.get("TITANRL_TEST_STALL")
    while marker and os.path.exists(marker):
        time.sleep(0.2)
    return exact_match_with_format(response, record)
