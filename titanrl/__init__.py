"""titanrl: PyTorch-native RL for vision-language models.

Kept import-light on purpose: the platform-compat startup hook imports
``titanrl._platform_compat`` in every interpreter, so nothing heavy may load here.
"""

__version__ = "0.1.0"
