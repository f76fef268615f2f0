"""Playing episodes: the token bookkeeping, the episode loop, the thread pool and the LLM front.

- `episode_loop.py`: one episode (env session -> generate -> parse -> step -> observe ... -> evaluate -> release);
- `env_manager.py`: ParallelEnvManager, a thread pool of episode loops sharing one LLM front;
- `handler.py`: RolloutHandler, the exact token ids and masks of one episode;
- `batch.py`: episodes -> the DataProto verl's fit() consumes (failures masked);
- `llm.py`: AsyncLLMServerManager, the one LLM front, and its backends (vLLM over HTTP, verl's client);
- `rounds.py`: RoundsConfig and RoundLimit (fixed, ScalingInter-RL, adaptive); `async_pool.py` / `versions.py`: bounded-staleness rollout;
- `scripted.py` / `hf_policy.py`: policies without a server (tests, Agent-R's revisions).

The action parsers are `beyond_agent.actions`; verl's rollout-manager seam is `beyond_agent.rollout_manager`.

Nothing is imported here, so that importing one module does not import them all.
"""
