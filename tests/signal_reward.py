"""A reward the tiny model's random policy scores on, for equality tests that need a learning signal: it varies
within every GRPO group (it reads the response's length and letters), so the advantages are non-zero and the
policy-gradient term moves the parameters; and it says which responses are "correct" (an even length), so the
accuracies of the step line and of evaluations are not all 0. Deterministic: two runs that sample the same responses
score them alike."""


def reward(response: str, record) -> dict:
    return {"score": (len(response) % 5) / 4.0 + 0.1 * response.count("e"), "correct": float(len(response) % 2 == 0)}
