"""The BeyondAgent environment service: text environments behind one HTTP protocol.

To write an environment, subclass `TextEnv` (its docstring is the contract; `Task` is what `reset` gets)
and register it: in a package of your own, with an entry point in the group `envservice.envs`
(`myenv = "my_package.module:MyEnv"`), or with `register("myenv", "my_package.module:MyEnv")`.
`check_env("myenv")` (or `python -m envservice.check myenv`) checks it against the contract, and
`python -m envservice.check --hacks myenv` plays hostile policies against its reward (`Hack` declares one of your
own: `TextEnv.hacks`). `Param` declares
a typed create option; `clip_text` cuts an action an observation quotes back (an action may be 100 000
characters long).
"""

from envservice.check import check_env
from envservice.envs.base import Hack, Param, Task, TextEnv, clip_text
from envservice.registry import register

__all__ = ["Hack", "Param", "Task", "TextEnv", "check_env", "clip_text", "register"]
