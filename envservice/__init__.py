"""The BeyondAgent environment service: text environments behind one HTTP protocol.

To write an environment, subclass `TextEnv` (its docstring is the contract; `Task` is what `reset` gets)
and register it: in a package of your own, with an entry point in the group `envservice.envs`
(`myenv = "my_package.module:MyEnv"`), or with `register("myenv", "my_package.module:MyEnv")`.
`check_env("myenv")` (or `python -m envservice.check myenv`) checks it against the contract.
"""

from envservice.check import check_env
from envservice.envs.base import Task, TextEnv
from envservice.registry import register

__all__ = ["Task", "TextEnv", "check_env", "register"]
