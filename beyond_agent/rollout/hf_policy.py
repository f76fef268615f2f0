"""An EpisodeLoop `generate` function backed by a Hugging Face model in this process (greedy or sampled).

For small models on CPU (the learning check, Agent-R's search with the tiny model, tests); runs at scale
use vLLM through `AsyncLLMServerManager.with_sampling`, which has the same signature.
"""

from __future__ import annotations

from beyond_agent.rollout.scripted import ScriptedTurn


class TransformersPolicy:
    """generate(request_id, prompt_ids, max_tokens) with `model.generate`; temperature 0 is greedy."""

    def __init__(self, model, eos_token_id: int, temperature: float):
        self.model = model
        self.eos_token_id = eos_token_id
        self.temperature = temperature

    @classmethod
    def from_pretrained(cls, model_dir: str, temperature: float) -> "TransformersPolicy":
        """The policy of a Hugging Face model folder (weights and tokenizer), in eval mode."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        eos_token_id = AutoTokenizer.from_pretrained(model_dir).eos_token_id
        return cls(AutoModelForCausalLM.from_pretrained(model_dir).eval(), eos_token_id, temperature)

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> ScriptedTurn:
        import torch

        sampling = ({"do_sample": True, "temperature": self.temperature, "top_k": 0} if self.temperature > 0
                    else {"do_sample": False})
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_tokens, eos_token_id=self.eos_token_id, pad_token_id=self.eos_token_id,
                **sampling,
            )
        return ScriptedTurn(token_ids=out[0, len(prompt_ids):].tolist())
