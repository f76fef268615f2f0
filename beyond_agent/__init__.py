"""BeyondAgent's library: the parts every program (the recipes under `recipe/`, the benches, the viewer) uses.

Importing this package imports nothing else; each module is imported on its own:

    rollout/         one episode's token bookkeeping (handler), the episode loop (episode_loop), the thread pool
                     over many (env_manager), the LLM front (llm), round limits (rounds), batch assembly
                     (batch), the bounded-staleness pool (async_pool, versions), scripted and HF policies
    rollout_manager  verl's rollout seam: a step's batch of tasks -> episodes -> DataProto
    actions          parsers from model text to env actions
    tasks            what a dataset row asks an env to do, and its parsers
    multitask        several envs in one run: per-task settings and metrics
    integrity        monitors that warn or stop a run whose learning signal looks broken (a reward hack, log-prob drift)
    settings         the recipe's config sections read from the Hydra config
    run_recipe       what every RL recipe's main does around its trainer: config checks, verl's run_ppo, the
                     TaskRunner (a recipe is its trainer, its YAML and `run_recipe(Trainer, config)`)
    trajectories     the episode dump schema and writer; trajectory_data reads dumps into SFT/DPO rows
    run_folder       the names and readers of an experiment folder; curves draws its metrics as a PNG
    weights/         weight-sync codecs (full and delta) and their verl seams
    algorithms/      losses registered with verl (M2PO), Agent-R's revision pairing and MCTS
    evaluation       the one evaluation API: evaluate(policy, env, tasks, settings) -> Evaluation, serve_policy
    serving          a local vLLM server for evaluation and collection
    cli_args         argument types the command-line programs share (task ranges, JSON params)
    verl_pin         the verl release we are built for, checked at start-up
    viewer/          the run viewer (`python -m beyond_agent.viewer RUN_DIR`); nothing here imports it

The layering is checked by import-linter (`lint-imports`, contracts in pyproject.toml).
"""
