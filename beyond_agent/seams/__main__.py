"""`python -m beyond_agent.seams`: every seam to verl, vLLM, uvicorn and torch, checked against what is installed
(exit 1 when one no longer holds)."""

from beyond_agent.seams import seam_problems, table

if __name__ == "__main__":
    print(table())
    problems = seam_problems()
    for problem in problems:
        print(f"does not hold: {problem}")
    raise SystemExit(1 if problems else 0)
