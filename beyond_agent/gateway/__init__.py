"""The gateway: train agents people already have (an OpenAI-compatible server in front of the rollout's LLM).

`server.Gateway` answers `/episodes/<id>/v1/chat/completions` and records every call with exact token ids
(`episodes.CallRecord`); `episodes.GatewayEpisode` turns an episode's calls into training samples (one merged
sample when the agent only appends to its history, one per call when it rewrites it); `wire` is the OpenAI
format.
"""

from beyond_agent.gateway.episodes import CallRecord, GatewayEpisode
from beyond_agent.gateway.server import Gateway, GatewayConfig, GatewayError, create_gateway_app

__all__ = ["CallRecord", "Gateway", "GatewayConfig", "GatewayEpisode", "GatewayError", "create_gateway_app"]
