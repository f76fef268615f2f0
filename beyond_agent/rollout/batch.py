"""Batch assembly, in one place: finished episodes -> the DataProto verl's `fit()` takes from
`generate_sequences`.

- `collate` pads episodes into verl's tensors (prompts left-padded, responses right-padded) with the
  episode reward as `rm_scores` and the per-turn env rewards as `step_rewards` (a cut episode's last turn with its
  forfeit added: episode_loop.py; each row's `forfeit` says so, for GiGPO).
- `training_batch` is what the rollout manager returns: infrastructure failures kept out of training
  (`excluded_rows`), collated, with the input rows' non-tensor fields and our own (`success`, `agent_task`).
- `segment_batch` and `add_segment_rows`: a per_call agent episode's earlier samples, and the other seats of a
  self-play game, as rows verl's training batch gets after `fit()` joined it with the rollout's (the trainer adds
  them).

Infrastructure failures (`env_error`, `llm_error`, `timeout`) are not reward. Their rows stay (verl's
`fit()` needs every row back, in order) but get response mask 0 and no reward; with a group-based
estimator (GRPO, RLOO, ...) their whole group goes with them, because the group's baseline would otherwise
be computed from the survivors only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec
from beyond_agent.rollout.handler import TERMINATION_REASONS, Episode, RolloutHandler

if TYPE_CHECKING:
    from verl import DataProto


def training_batch(results: Sequence[EpisodeResult], inputs: Any, pad_token_id: int, max_prompt_length: int,
                   max_response_length: int, group_based: bool) -> DataProto:
    """The rollout batch for verl, row i being results[i] (the input batch's row i), failures masked.

    `inputs` is the DataProto `generate_sequences` was called with (None outside training): its non-tensor
    fields come back unchanged, since verl unions this batch with its own copy.
    """
    batch = _result_rows(results, excluded_rows(results, group_based), pad_token_id, max_prompt_length,
                         max_response_length)
    for key, values in (inputs.non_tensor_batch.items() if inputs is not None else ()):
        batch.non_tensor_batch[key] = values
    return batch


@dataclass
class SegmentRows:
    """The earlier segments of a rollout's per_call agent episodes, and the other seats of its self-play games, as
    rows to add to verl's training batch."""

    origins: list[int]
    """Per row: the row of the episode it belongs to in the rollout batch (whose input fields, GRPO group
    included, it shares; a seat's row then moves to its seat's group: `add_segment_rows`)."""
    rows: DataProto
    """Their tensors and our non-tensor fields, collated like the rollout batch."""


def segment_batch(results: Sequence[EpisodeResult], pad_token_id: int, max_prompt_length: int,
                  max_response_length: int, group_based: bool) -> SegmentRows | None:
    """The rows of every `EpisodeResult.earlier_segments` and `other_seats` of `results` (a rollout batch's
    episodes, in row order), or None when no episode has any (our own loop played one-player episodes).

    Verl's `fit()` joins the rollout's rows one to one with its input rows, so these cannot come back from
    `generate_sequences`; the trainer adds them to the batch afterwards (`add_segment_rows`).
    """
    added = [(row, extra, forfeit) for row, result in enumerate(results) for extra, forfeit in _extra_rows(result)]
    if not added:
        return None
    origins = [row for row, _, _ in added]
    excluded_episodes = excluded_rows(results, group_based)
    # Rule: a segment of an excluded episode (an infrastructure failure, or in a group with one) is excluded
    # with it: it is the same episode, and its group's baseline would lack the failed episodes. The same holds for
    # the other seats of a game: a failure voids every seat, and the row's groups go together.
    excluded = {i for i, origin in enumerate(origins) if origin in excluded_episodes}
    return SegmentRows(origins, _result_rows([extra for _, extra, _ in added], excluded, pad_token_id,
                                             max_prompt_length, max_response_length,
                                             forfeits=[forfeit for _, _, forfeit in added]))


def _extra_rows(result: EpisodeResult) -> list[tuple[EpisodeResult, float | None]]:
    """The rows `result` trains besides its own, each with the forfeit its turns carry (`EpisodeResult.forfeit`).

    Rule: a per_call agent's earlier segments carry their episode's forfeit: a limit cuts the episode, not a
    segment, and a segment's step returns run on to the episode's last turn, which holds it. A self-play game's
    other seats carry their own: only the seat the limit stopped forfeits, the others won by walkover."""
    return ([(segment, result.forfeit) for segment in result.earlier_segments]
            + [(seat, seat.forfeit) for seat in result.other_seats])


def add_segment_rows(batch: DataProto, segments: SegmentRows | None, rows_multiple: int,
                     pad_token_id: int) -> dict[str, int]:
    """Grow verl's training batch in place (fit() holds the object): the added rows after the episodes' rows,
    then pad rows until the row count is a multiple of `rows_multiple` (verl's mini-batch in rows, which also
    divides by the data-parallel size); returns how many of each were added.

    An added row copies every field of its episode's row (`uid`, so a segment joins the episode's GRPO group;
    `data_source`, `extra_info`, ...) and takes its own tokens and rollout fields. A pad row is one pad token
    of prompt and of response and has a `uid` of its own. Then every row of a seat gets its seat's group.
    """
    parts, seat_rows = [batch], 0
    if segments is not None:
        parts.append(_rows_of(batch, segments.origins, segments.rows))
        seat_rows = int(sum(seat >= 0 for seat in segments.rows.non_tensor_batch["seat"]))
    episodes, size = len(batch), sum(len(part) for part in parts)
    pads = -size % rows_multiple
    if pads:
        placeholders = [EpisodeResult(spec=EpisodeSpec(env_id="pad"), episode=None, termination="done")] * pads
        pad = _rows_of(batch, [0] * pads, _result_rows(placeholders, set(range(pads)), pad_token_id,
                                                          batch.batch["prompts"].shape[1],
                                                          batch.batch["responses"].shape[1]))
        # Rule: a pad row is in no group (its own uid) and has mask 0: no estimator or loss reads it.
        pad.non_tensor_batch["uid"] = np.array([f"pad-{i}" for i in range(pads)], dtype=object)
        parts.append(pad)
    if len(parts) > 1:
        from verl import DataProto

        grown = DataProto.concat(parts)
        batch.batch, batch.non_tensor_batch = grown.batch, grown.non_tensor_batch
    _group_by_seat(batch)
    return {"segment_rows": size - episodes - seat_rows, "seat_rows": seat_rows, "pad_rows": pads}


def _group_by_seat(batch: DataProto) -> None:
    """Move every seat's row into its seat's group: uid `<row uid>/seat<k>`.

    Rule: in a zero-sum game a seat's outcome is the negative of its opponent's, so a group of both seats' episodes
    would only learn which seat won; GRPO compares a seat's episode with the same seat's in the other games of the
    same row."""
    seats = batch.non_tensor_batch.get("seat")
    if seats is None:
        return
    uids = batch.non_tensor_batch["uid"]
    for i, seat in enumerate(seats):
        if seat >= 0:
            uids[i] = f"{uids[i]}/seat{seat}"


def _rows_of(batch: DataProto, origins: list[int], rows: DataProto) -> DataProto:
    """Copies of batch's rows `origins` whose rollout fields (every field `rows` has) are `rows`'."""
    missing = sorted(set(batch.batch.keys()) & ROLLOUT_TENSORS - set(rows.batch.keys()))
    if missing:
        raise ValueError(f"the added rows lack the rollout fields {missing} that the batch has (e.g. log-probs "
                         "of some episodes and not others)")
    copies = batch.select_idxs(origins)
    for key in rows.batch.keys():
        if key in copies.batch.keys():
            copies.batch[key] = rows.batch[key]
    for key, values in rows.non_tensor_batch.items():
        if key in copies.non_tensor_batch:
            copies.non_tensor_batch[key] = values
    return copies


def _result_rows(results: Sequence[EpisodeResult], excluded: set[int], pad_token_id: int, max_prompt_length: int,
                 max_response_length: int, forfeits: Sequence[float | None] | None = None) -> DataProto:
    """The results collated, rows `excluded` masked, with our non-tensor fields (anchors, success, task);
    `forfeits`: each row's forfeit (default: each result's own, `EpisodeResult.forfeit`)."""
    episodes = [_masked(_episode_or_placeholder(r, pad_token_id)) if i in excluded
                else _episode_or_placeholder(r, pad_token_id) for i, r in enumerate(results)]
    batch = collate(episodes, pad_token_id, max_prompt_length, max_response_length)
    # Rule: an excluded row has no turns to credit (its tokens are all mask 0, its step rewards dropped).
    batch.non_tensor_batch["anchors"] = object_array([() if i in excluded else tuple(r.anchors)
                                                      for i, r in enumerate(results)])
    batch.non_tensor_batch["later_turn_rewards"] = object_array([() if i in excluded else tuple(r.later_step_rewards)
                                                                 for i, r in enumerate(results)])
    # The forfeit a cut episode's last turn carries (None: not cut): GiGPO counts it undiscounted at every turn.
    forfeits = [r.forfeit for r in results] if forfeits is None else forfeits
    batch.non_tensor_batch["forfeit"] = object_array([None if i in excluded else forfeit
                                                      for i, forfeit in enumerate(forfeits)])
    # An episode's rows (a per_call agent's segments) share its key: GiGPO counts the episode once in its group.
    batch.non_tensor_batch["episode_key"] = np.array([f"{r.spec.group_id}/{r.spec.index}" for r in results],
                                                     dtype=object)
    batch.non_tensor_batch["success"] = np.array([float(r.success) for r in results], dtype=np.float32)
    batch.non_tensor_batch["agent_task"] = np.array([r.spec.agent_task.label for r in results], dtype=object)
    # The seat each row played in a game of several seats (-1: a one-player episode); `add_segment_rows` groups by it.
    batch.non_tensor_batch["seat"] = np.array([-1 if r.spec.seat is None else r.spec.seat for r in results],
                                              dtype=np.int64)
    batch.non_tensor_batch["multi_modal_inputs"] = np.array([{} for _ in results], dtype=object)
    return batch


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-d object array of the given values (np.array would turn equal-length tuples into a 2-d array)."""
    array = np.empty(len(values), dtype=object)
    for index, value in enumerate(values):
        array[index] = value
    return array


class NothingToTrain(RuntimeError):
    """A training step whose batch has no token to train on: every episode failed in the infrastructure, or sits in
    a group with such a failure (`untrainable`)."""


def untrainable(results: Sequence[EpisodeResult], response_mask: Any) -> str | None:
    """Why a training batch has no token to train on (its response mask is all 0), naming how its episodes ended
    and the first error; None when it has one. verl's update cannot use such a batch (its rollout correction
    stops with "response_mask must contain at least one valid token"), which says nothing of the cause: an LLM
    server killed for memory, an envservice gone."""
    if bool(response_mask.any()):
        return None
    ends = Counter(result.termination for result in results)
    counts = ", ".join(f"{number} {termination}" for termination, number in sorted(ends.items()))
    first_error = next((result.error for result in results if result.error), None)
    return (f"no token of its {len(results)} episodes can be trained on ({counts}; an infrastructure failure masks "
            f"its episode, and with a group estimator its group)"
            + (f"; the first error: {first_error[:500]}" if first_error else ""))


def excluded_rows(results: Sequence[EpisodeResult], group_based: bool) -> set[int]:
    """Rows to keep out of training: infra failures, and with a group estimator their whole group."""
    failed = {i for i, r in enumerate(results) if r.infra_failure}
    if not group_based:
        return failed
    failed_groups = {results[i].spec.group_id for i in failed}
    return {i for i, r in enumerate(results) if r.spec.group_id in failed_groups}


def _masked(episode: Episode) -> Episode:
    # Rule: a failed episode's tokens are not the policy's behaviour in a working world, so none of them
    # is trained on (mask 0) and it carries no reward, not even step rewards.
    return Episode(prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
                   response_mask=[0] * len(episode.response_ids),
                   response_logprobs=episode.response_logprobs, reward=0.0,
                   termination=episode.termination, num_turns=episode.num_turns,
                   prompt_truncated=episode.prompt_truncated)


def _episode_or_placeholder(result: EpisodeResult, pad_token_id: int) -> Episode:
    """The result's episode, or a one-token placeholder for one that failed before its prompt existed."""
    if result.episode is not None:
        return result.episode
    # Rule: a row must exist to keep the batch's shape; it holds one pad token and nothing to train on.
    return Episode(prompt_ids=[pad_token_id], response_ids=[pad_token_id], response_mask=[0],
                   response_logprobs=[0.0], reward=0.0, termination=result.termination)


ROLLOUT_TENSORS = frozenset({"prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                             "rm_scores", "step_rewards", "rollout_log_probs"})
"""The tensors `collate` makes (every row of a batch needs its own values of these)."""


def collate(
    episodes: Sequence[Episode | RolloutHandler],
    pad_token_id: int,
    max_prompt_length: int,
    max_response_length: int,
) -> DataProto:
    """Pad finished episodes into the DataProto verl's trainer expects from `generate_sequences`.

    Prompts are left-padded to max_prompt_length and responses right-padded to max_response_length, so
    every row's prompt ends and response starts at the same column. `rm_scores` holds each episode's
    reward on its last policy token; `step_rewards` each turn's env reward on that turn's last token (for
    step-level credit methods; verl's estimators read only `rm_scores`). `rollout_log_probs` is present only
    if every episode has log-probs. Non-tensor fields: `termination`, `__num_turns__`, `prompt_truncated`, per
    turn `turn_ends` (its last response position; -1 for a turn that kept no token) and `turn_rewards`, and per
    generation request `turn_contexts` ((length, digest) of the ids the LLM was given).
    """
    from verl import DataProto  # imported here: importing verl takes seconds, the handler does not need it

    rows = [e.to_episode() if isinstance(e, RolloutHandler) else e for e in episodes]
    if not rows:
        raise ValueError("collate needs at least one episode")
    for i, row in enumerate(rows):
        _check_episode(i, row, max_prompt_length, max_response_length)
    tensors = _sequence_tensors(rows, pad_token_id, max_prompt_length, max_response_length)
    tensors["rm_scores"] = _reward_tensor(rows, tensors["response_mask"])  # [batch, response]
    tensors["step_rewards"] = _step_reward_tensor(rows, max_response_length)  # [batch, response]
    if all(row.response_logprobs is not None for row in rows):
        # Padding gets 0.0; verl only reads positions where response_mask is 1.
        positions = _flat_positions(_lengths(r.response_ids for r in rows), max_response_length, left=False)
        tensors["rollout_log_probs"] = _pad(
            [row.response_logprobs for row in rows], positions, max_response_length, 0.0, np.float32
        )  # [batch, response]
    non_tensors = {
        # Per turn (GiGPO, beyond_agent/algorithms/gigpo.py): where it ends in the response, and its env reward.
        "turn_ends": object_array([tuple(row.turn_ends) for row in rows]),
        "turn_rewards": object_array([tuple(row.step_rewards) for row in rows]),
        # Per generation request: (length, digest) of the ids the LLM continued, each a prefix of the row's ids
        # (checked on the batch the actor trains on: beyond_agent.integrity.prefix).
        "turn_contexts": object_array([tuple(row.turn_contexts) for row in rows]),
        "termination": np.array([row.termination for row in rows], dtype=object),
        "__num_turns__": np.array([row.num_turns for row in rows], dtype=np.int32),
        "prompt_truncated": np.array([row.prompt_truncated for row in rows], dtype=bool),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _sequence_tensors(rows: list[Episode], pad_id: int, prompt_len: int, response_len: int) -> dict:
    """prompts, responses, response_mask, input_ids, attention_mask, position_ids."""
    prompt_lengths = _lengths(r.prompt_ids for r in rows)
    response_lengths = _lengths(r.response_ids for r in rows)
    prompt_at = _flat_positions(prompt_lengths, prompt_len, left=True)
    response_at = _flat_positions(response_lengths, response_len, left=False)
    prompts = _pad([r.prompt_ids for r in rows], prompt_at, prompt_len, pad_id, np.int64)  # [batch, prompt]
    responses = _pad([r.response_ids for r in rows], response_at, response_len, pad_id, np.int64)
    # Padding is never trained on: the mask is padded with 0.
    response_mask = _pad([r.response_mask for r in rows], response_at, response_len, 0, np.int64)
    # Left-padded prompt + right-padded response: each row's real tokens are one run starting here.
    starts = prompt_len - prompt_lengths
    lengths = prompt_lengths + response_lengths
    width = prompt_len + response_len
    attention_mask = np.zeros((len(rows), width), dtype=np.int64)  # [batch, prompt + response]
    attention_mask.reshape(-1)[_runs(np.arange(len(rows)) * width + starts, lengths)] = 1
    # Positions count real tokens only: left padding sits at 0 and right padding repeats the last
    # position, as verl's compute_position_id_with_mask (cumsum(mask) - 1, clamped at 0) gives.
    position_ids = np.arange(width) - starts[:, None]  # [batch, prompt + response]
    np.clip(position_ids, 0, np.maximum(lengths - 1, 0)[:, None], out=position_ids)
    return {
        "prompts": prompts,  # [batch, prompt]
        "responses": responses,  # [batch, response]
        "response_mask": response_mask,  # [batch, response]
        "input_ids": torch.cat([prompts, responses], dim=1),  # [batch, prompt + response]
        "attention_mask": torch.from_numpy(attention_mask),
        "position_ids": torch.from_numpy(position_ids),
    }


def _reward_tensor(rows: list[Episode], response_mask: torch.Tensor) -> torch.Tensor:
    """Each reward on its row's last policy token (mask 1), zeros elsewhere.

    Why the last mask-1 token and not simply the last response token: an episode cut by the length limit
    can end inside an observation (mask 0), and verl's GAE and REINFORCE++ skip mask-0 positions when
    they propagate returns, so a reward sitting there would be lost (tests/trainer shows it with verl's
    own functions). Sum-based estimators (GRPO, RLOO) see the same total either way. A row with no
    policy token keeps its reward on its last response token; an empty response gets no reward.
    """
    policy = response_mask.numpy() == 1  # [batch, response]; padding is 0, so never a policy token
    last_policy = policy.shape[1] - 1 - np.argmax(policy[:, ::-1], axis=1)
    last_token = _lengths(r.response_ids for r in rows) - 1
    position = np.where(policy.any(axis=1), last_policy, last_token)
    rewarded = np.flatnonzero(position >= 0)  # an empty response (position -1) gets no reward
    scores = np.zeros(policy.shape, dtype=np.float32)  # [batch, response]
    scores[rewarded, position[rewarded]] = np.array([float(rows[i].reward) for i in rewarded], dtype=np.float64)
    return torch.from_numpy(scores)


def _step_reward_tensor(rows: list[Episode], width: int) -> torch.Tensor:
    """Each turn's step reward on the last token that turn kept; turns that kept none carry nothing."""
    scores = np.zeros((len(rows), width), dtype=np.float32)  # [batch, response]
    for row, episode in enumerate(rows):
        for end, reward in zip(episode.turn_ends, episode.step_rewards):
            if end >= 0:
                scores[row, end] += reward
    return torch.from_numpy(scores)


def _lengths(rows) -> np.ndarray:
    return np.array([len(row) for row in rows], dtype=np.int64)


def _flat_positions(lengths: np.ndarray, width: int, left: bool) -> np.ndarray:
    """Where each value of the concatenated rows goes in a flattened [batch, width] array, each row
    padded on the left or the right."""
    starts = np.arange(len(lengths)) * width + (width - lengths if left else 0)
    return _runs(starts, lengths)


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start[i] .. start[i] + lengths[i] - 1 for every i, concatenated."""
    offsets = np.cumsum(lengths) - lengths  # where row i's values begin in the concatenation
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def _pad(rows: list[Sequence], positions: np.ndarray, width: int, value, dtype) -> torch.Tensor:
    """[batch, width] filled with `value`, the rows' values written at `positions` in one concatenation."""
    out = np.full((len(rows), width), value, dtype=dtype)
    out.reshape(-1)[positions] = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=len(positions))
    return torch.from_numpy(out)


def _check_episode(index: int, row: Episode, prompt_len: int, response_len: int) -> None:
    """Fail with the episode index and the field when an episode does not fit the batch."""
    if row.termination not in TERMINATION_REASONS:
        raise ValueError(
            f"episode {index} has termination={row.termination!r}; call finish() with one of {TERMINATION_REASONS}"
        )
    if len(row.prompt_ids) > prompt_len:
        raise ValueError(
            f"episode {index}: prompt_ids has {len(row.prompt_ids)} tokens > max_prompt_length={prompt_len}"
        )
    if len(row.response_ids) > response_len:
        raise ValueError(
            f"episode {index}: response_ids has {len(row.response_ids)} tokens > max_response_length={response_len}"
        )
    lengths = {"response_mask": len(row.response_mask)}
    if row.response_logprobs is not None:
        lengths["response_logprobs"] = len(row.response_logprobs)
    for name, length in lengths.items():
        if length != len(row.response_ids):
            raise ValueError(
                f"episode {index}: {name} has {length} values but response_ids has {len(row.response_ids)}"
            )
