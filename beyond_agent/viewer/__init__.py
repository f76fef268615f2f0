"""The run viewer: a local web page over an experiment folder, read live while training runs.

    python -m beyond_agent.viewer EXPERIMENT_DIR [--port P] [--host 127.0.0.1] [--tokenizer PATH]
    python -m beyond_agent.viewer EXPERIMENT_DIR --png curves.png     # the curves as a PNG, then exit
    python launcher.py --conf x.yaml --with-envservice --with-viewer         # beside training, stopped with it

The dashboard draws the run's curves (success, reward, rounds, terminations, env/LLM time, entropy, losses,
staleness and per-task metrics when logged, validation points) and shows its config and versions; the
episode pages list each dumped step's episodes with filters and show one episode turn by turn with its
exact tokens, the trained ones (response mask 1) marked, log-probs on hover, and a second episode of the
same group beside it. See app.py for the JSON API and curves.py for which metric draws which curve.
"""
