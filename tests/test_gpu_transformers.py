"""transformers' Qwen3.5 model with its GDN prefill swapped for gdn_aot's fla shim, as a serving integration swaps
it: a tiny random model with the real GDN head shapes (K = V = 128, 2 key heads, 4 value heads), a prefill, then
decode steps that transformers runs from the final state gdn_aot wrote, against the model's own implementation
(transformers' torch path, or fla where installed). Skipped without a transformers that has Qwen3.5."""
import inspect

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                               reason="needs transformers with the Qwen3.5 model")

PROMPT, DECODE_STEPS = 100, 4
# bf16 weights and activations through a linear-attention and a full-attention layer: both implementations round
# differently at every layer, so their logits differ by ~1% of the largest logit
LOGIT_TOL = 0.03


def tiny_model():
    config = modeling.Qwen3_5TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=1024)
    torch.manual_seed(0)
    return modeling.Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16).eval()


def prefill_and_decode(model, prompt, steps):
    """The logits of the prompt's tokens, then of each decode step fed `steps` (teacher forcing: both
    implementations see the same tokens), the recurrent state carried by the model's cache."""
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        logits, cache = [out.logits.float()], out.past_key_values
        for i in range(steps.shape[1]):
            out = model(steps[:, i:i + 1], use_cache=True, **{cache_kw: cache})
            logits.append(out.logits.float())
            cache = out.past_key_values
    return logits


def test_qwen35_prefill_through_the_shim_then_decode(monkeypatch):
    from gdn_aot.loader.fla_compat import chunk_gated_delta_rule as shim

    model = tiny_model()
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, 512, (2, PROMPT), device="cuda", generator=gen)
    steps = torch.randint(0, 512, (2, DECODE_STEPS), device="cuda", generator=gen)
    reference = prefill_and_decode(model, prompt, steps)

    calls = []

    def prefill(query, key, value, **kwargs):
        calls.append((tuple(query.shape), value.stride()))
        return shim(query, key, value, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", prefill)
    ours = prefill_and_decode(model, prompt, steps)
    assert calls and calls[0][0][:2] == (2, PROMPT), "the prefill went through gdn_aot"
    for step, (want, got) in enumerate(zip(reference, ours)):
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= LOGIT_TOL, (f"{'prefill' if step == 0 else f'decode step {step}'}: logits differ by {err:.2%} "
                                  f"of the largest (v strides {calls[0][1]})")
