"""The rollout side of the BeyondAgent recipe.

- `dataflow.py`: one episode (env session -> generate -> parse -> step -> observe ... -> evaluate -> release);
- `env_manager.py`: ParallelEnvManager, a thread pool of dataflows sharing one LLM front;
- `handler.py`: RolloutHandler, the exact token ids and masks of one episode;
- `batch.py`: episodes -> the DataProto verl's fit() consumes (failures masked);
- `llm.py`: AsyncLLMServerManager, the one LLM front, and its backends (vLLM over HTTP, verl's client);
- `actions.py`: action parsers; `rounds.py`: RoundScheduler (ScalingInter-RL);

Nothing is imported here, so that importing one module does not import them all.
"""
