"""The pieces behind `launcher.py`: config (.env + launcher YAML), services, experiment folder, signals, training.

    python launcher.py --conf examples/quickstart/cpu_tiny.yaml --with-envservice

`cli.main` reads top to bottom: load the config, start the services we were asked for, write the
experiment folder, run the preparation commands and training, and always stop exactly what we started.
"""
