"""Secrets never leave the launcher in clear: one `Redactor` for everything it prints or writes.

Hiding values by their name alone misses secrets that travel without a telling name: `--token z` in a
service's arguments, a `user:pass@` URL, `DB_PASS` in `train.env`, the verbatim copy of the launcher YAML.
So the launcher first collects the secret *values* of a run (`collect_secrets`): every value of `.env`
(whatever its name: `SENTRY_DSN`, `SLACK_WEBHOOK_URL`, `MY_AUTH=Bearer ...`) but those that are plainly
settings (numbers, booleans, host addresses, file paths: `NOT_SECRET_VALUE`), every value whose name looks
secret (`SECRET_NAME`) in `train.env`, a service's `env` and `env_file` and the launcher's own environment
(`HUGGING_FACE_HUB_TOKEN` from the parent shell), every argument that follows (or is joined by `=` to) a
secret-looking flag or Hydra key in any command. Then `Redactor.text` replaces each of those values where it
stands as a whole token (also as a shell or JSON quoting writes it), and by their pattern: URL passwords (with
or without a user), secret-named query parameters (`?access_token=...`) and `Bearer` credentials. The
experiment folder's files (config.yaml, launcher.yaml, command.txt), the launcher's messages, its dry run and
the teed training log all go through it.

Values shorter than `MIN_SECRET_LENGTH`, and plain settings, are hidden where their name shows them but not
searched for in free text (replacing every "18432" or "127.0.0.1" of a log is no protection and ruins it); names
that count tokens (`ppo_max_token_len_per_gpu`, `max_tokens`) are not secret names.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

SECRET_NAME = re.compile(r"TOKEN(?![a-z])|SECRET|PASS|PWD|CREDENTIAL|APIKEY|(?<![a-z])KEY(?![a-z])", re.IGNORECASE)
"""Names whose values are secret (HF_TOKEN, WANDB_API_KEY, DB_PASS, --api-key, beyond_agent.env.token); KEY
only as a word of its own (not `keyword`), TOKEN not followed by more letters (not `max_tokens_per_turn` or
`TOKENIZERS_PARALLELISM`, whose values were hidden)."""
COUNTING_NAME = re.compile(r"TOKENS?_?(?:LEN|LENGTH|COUNT|NUM|LIMIT|BUDGET|SIZE|PER)|(?:MAX|MIN|NUM)_?TOKEN",
                           re.IGNORECASE)
"""Names that count tokens rather than hold one (`ppo_max_token_len_per_gpu`, `max_token_budget`)."""
HIDDEN = "***"
MIN_SECRET_LENGTH = 4
URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][\w+.-]*://[^\s/:@]*):(?P<password>[^\s@/]+)@")
"""scheme://user:password@host or scheme://:password@host: the password part."""
QUERY_PARAMETER = re.compile(r"(?P<head>[?&](?P<name>[\w.-]+)=)(?P<value>[^&#\s'\"]+)")
"""A URL's query parameter (`?access_token=...`); hidden when its name looks secret."""
BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[\w.~+/=-]+)", re.IGNORECASE)
"""An HTTP `Bearer` credential, wherever it is written."""


@dataclass(frozen=True)
class Redactor:
    """Replaces a run's secret values (and URL passwords) with `***` in text and in nested data."""

    secrets: frozenset[str] = frozenset()

    def text(self, text: str) -> str:
        """`text` with every known secret value (where it stands as a whole token), every URL password,
        secret-named query parameter and Bearer credential hidden."""
        if self.secrets:
            text = self._pattern.sub(HIDDEN, text)
        text = URL_PASSWORD.sub(rf"\g<head>:{HIDDEN}@", text)
        text = QUERY_PARAMETER.sub(lambda m: m["head"] + HIDDEN if is_secret_name(m["name"]) else m[0], text)
        return BEARER.sub(rf"\g<head>{HIDDEN}", text)

    @cached_property
    def _pattern(self) -> re.Pattern:
        """Every secret, as written plainly, shell-quoted or JSON-escaped, as a whole token (not inside a longer
        word or number); longer first, since a longer secret may contain a shorter one."""
        spellings = {spelling for secret in self.secrets for spelling in _spellings(secret)}
        alternatives = "|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True))
        return re.compile(rf"(?<![\w])(?:{alternatives})(?![\w])")

    def data(self, value: Any) -> Any:
        """A copy of nested dicts/lists/strings with every string redacted (`text`)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.data(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(item) for item in value]
        return value


def _spellings(secret: str) -> set[str]:
    """How a value may be written: as is, quoted for a shell, escaped inside a JSON string."""
    return {secret, shlex.quote(secret), json.dumps(secret)[1:-1]}


def is_secret_name(name: str) -> bool:
    """Whether a variable, flag or config key names a secret."""
    return bool(SECRET_NAME.search(name)) and not COUNTING_NAME.search(name)


_HOST = r"(?:localhost|\d{1,3}(?:\.\d{1,3}){3})"
NOT_SECRET_VALUE = re.compile(rf"[+-]?\d+(?:\.\d+)?|(?i:true|false|yes|no|none|null)|{_HOST}|(?:/|\./|\.\./|~/)\S*"
                              rf"|https?://{_HOST}(?::\d+)?(?:/[^?#@\s]*)?")
"""Values that are plainly settings, never searched for as secrets: numbers, booleans, host addresses, file
paths, and URLs of a host address with neither credentials nor query (hiding every "127.0.0.1" or "18432" of a
log protects nothing and ruins it). A URL of a named host stays a secret: a webhook's path is its key."""


def searchable(value: str) -> bool:
    """Whether a secret value is looked for in free text: long enough, and not plainly a setting
    (`NOT_SECRET_VALUE`)."""
    return len(value) >= MIN_SECRET_LENGTH and not NOT_SECRET_VALUE.fullmatch(value.strip())


def redact_dotenv(values: dict[str, str]) -> dict[str, str]:
    """`.env` as the record shows it: every value hidden but plain settings whose name is not secret."""
    return {key: HIDDEN if value and (is_secret_name(key) or searchable(value)) else value
            for key, value in values.items()}


def redact_by_name(values: dict[str, str]) -> dict[str, str]:
    """A mapping whose secret-named entries read `***` (empty values stay empty)."""
    return {key: HIDDEN if value and is_secret_name(key) else value for key, value in values.items()}


def secrets_in_mapping(values: dict[str, str]) -> set[str]:
    """The values of the secret-named entries."""
    return {str(value) for key, value in values.items() if value and is_secret_name(key)}


def secrets_in_arguments(arguments: Iterable[str]) -> set[str]:
    """Values given to secret-looking flags or keys: `--token z`, `--api-key=z`, `a.b.token=z`, `+x.password=z`."""
    found: set[str] = set()
    arguments = [str(argument) for argument in arguments]
    for index, argument in enumerate(arguments):
        name, joined, value = argument.partition("=")
        if joined and is_secret_name(name.rsplit(".", 1)[-1]) and value:
            found.add(value)
        elif argument.startswith("-") and is_secret_name(argument) and index + 1 < len(arguments):
            found.add(arguments[index + 1])
    return found


def secrets_in_env_file(path: str | None) -> set[str]:
    """Secret-named values of a KEY=VALUE file (a service's `env_file`), when it can be read."""
    if not path or not Path(path).is_file():
        return set()
    found = set()
    for line in Path(path).read_text(errors="replace").splitlines():
        key, joined, value = line.strip().removeprefix("export ").partition("=")
        if joined and is_secret_name(key) and value.strip().strip("'\""):
            found.add(value.strip().strip("'\""))
    return found


def collect_secrets(mappings: Iterable[dict[str, str]], commands: Iterable[Iterable[str]],
                    env_files: Iterable[str | None] = (), all_secret: Iterable[dict[str, str]] = ()) -> Redactor:
    """The redactor of a run: secret values from its env mappings (by name), its commands' arguments, its env
    files, and every value of the `all_secret` mappings (`.env`)."""
    secrets: set[str] = set()
    for mapping in all_secret:
        secrets |= {str(value) for value in mapping.values() if value}
    for mapping in mappings:
        secrets |= secrets_in_mapping(mapping)
    for command in commands:
        secrets |= secrets_in_arguments(command)
    for path in env_files:
        secrets |= secrets_in_env_file(path)
    return Redactor(frozenset(secret for secret in secrets if searchable(secret)))
