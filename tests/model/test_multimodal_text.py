"""A multimodal checkpoint's text model runs alone: Gemma 3 4B and larger ship as
Gemma3ForConditionalGeneration (text config under text_config, weights under language_model.,
beside a vision tower), and the engine answers text prompts with the text half, as
transformers' model does for a prompt without images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_reference import hf_greedy, make_prompts

from kvcache import LLM, SamplingParams

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
    "initializer_range": 0.1,  # peaked logits: no greedy near-ties
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


@pytest.fixture(scope="module")
def multimodal_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=TEXT,
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=300,
        boi_token_index=301,
        eoi_token_index=302,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    folder = tmp_path_factory.mktemp("gemma3_multimodal")
    model.save_pretrained(folder)
    return folder, model


def test_text_prompts_match_the_multimodal_model(multimodal_gemma3: tuple) -> None:
    folder, hf = multimodal_gemma3
    prompts = make_prompts(300, seed=3)  # ids below the image markers
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 12, None) for p in prompts]
    llm = LLM(str(folder))
    assert llm.model.architecture == "Gemma3ForCausalLM"
    assert [layer.self_attn.sliding_window for layer in llm.model.layers] == [8, None]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs


def test_a_multimodal_checkpoint_of_another_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}',
        encoding="utf-8",
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration"):
        LLM(str(tmp_path))
