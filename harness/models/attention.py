"""A variant as a Hugging Face attention function: `transformers.AttentionInterface`.

transformers (>= 4.48, here 5.x) calls a registered function in place of its own attention
inside every attention layer: `fn(module, query, key, value, attention_mask, scaling=...,
dropout=..., **kwargs)` with query (B, H, N, D) and key, value (B, H_kv, N, D); it must
return (attn_output as (B, N, H, D), attention weights or None), as
`transformers.integrations.sdpa_attention.sdpa_attention_forward` does. The model's own
projections, rotary embeddings, residuals and norms run unchanged: only softmax(q k^T /
sqrt(D)) v is replaced (https://huggingface.co/docs/transformers/attention_interface).

`register(module)` registers one built variant under a name of its own and, beside it,
transformers' SDPA mask function for that name, so a model builds for it exactly the mask
it builds for SDPA: None when the window is unpadded and the mask is purely causal or
absent (windows are never padded). What a variant cannot honour is declared before
running (`model_reasons`, the variant's `unsupported_reasons`); the function itself
refuses, with the reason, anything undeclared that reaches it (a mask, dropout, another
scaling, a soft cap, cross attention) rather than compute something else.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch

from harness.errors import UsageError

PREFIX = "attnbench_"


def impl_name(variant: str, params: dict) -> str:
    """The attn_implementation name of a variant setting (no '/' or ':': those name hub kernels)."""
    digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return f"{PREFIX}{variant}_{digest}"


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, N, D) -> (B, H_kv * groups, N, D): query head h reads kv head h // groups."""
    if groups == 1:
        return x
    B, Hkv, N, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, N, D).reshape(B, Hkv * groups, N, D)


def attention_function(variant: torch.nn.Module):
    """The AttentionInterface function that computes a layer's attention with `variant`."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               is_causal=None, **kwargs):
        where = f"{variant.name} inside {type(module).__name__}"
        if attention_mask is not None:
            raise ValueError(f"{where}: an attention mask (padding or a pattern of the model's "
                             "own) is not supported; windows must be unpadded")
        if dropout:
            raise ValueError(f"{where}: attention dropout {dropout} is not supported (eval mode)")
        for name in ("softcap", "position_bias", "s_aux"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{where}: the model passes {name}, which is not supported")
        window = kwargs.get("sliding_window")
        if window is not None and window < key.shape[-2]:  # a window >= N changes nothing
            raise ValueError(f"{where}: the model's own sliding window {window} < N is not "
                             "supported")
        D = query.shape[-1]
        if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
            raise ValueError(f"{where}: scaling {scaling} is not 1/sqrt(D) = {D ** -0.5}")
        if key.shape[-2] != query.shape[-2] or value.shape[-1] != D:
            raise ValueError(f"{where}: query, key and value must share N and D (self-attention)")
        groups = query.shape[1] // key.shape[1]
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        o = variant(query, repeat_kv(key, groups), repeat_kv(value, groups), causal=causal)
        return o.transpose(1, 2).contiguous(), None  # (B, N, H, D)

    return attend


def register(variant: torch.nn.Module, params: dict) -> str:
    """Register a built variant with AttentionInterface (and SDPA's masks); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = impl_name(variant.name, params)
    AttentionInterface.register(name, attention_function(variant))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def model_class(path: str, causal: bool):
    """The class AutoModel (encoders) or AutoModelForCausalLM would load, from the config alone."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    auto = AutoModelForCausalLM if causal else AutoModel
    try:
        return auto._model_mapping[type(cfg)]
    except KeyError:
        raise UsageError(f"model {path!r}: transformers has no {auto.__name__} class for model "
                         f"type {cfg.model_type!r}") from None


def check_swappable(path: str, causal: bool) -> None:
    """UsageError unless the model's attention goes through AttentionInterface."""
    cls = model_class(path, causal)
    if not cls.is_backend_compatible():  # transformers' `_supports_attention_backend`
        raise UsageError(f"model {path!r}: {cls.__name__} does not route its attention through "
                         "transformers.AttentionInterface, so its attention cannot be swapped")


def model_reasons(model, head_dim: int, seq_len: int) -> list[str]:
    """Why no variant can stand in for this model's attention at N = seq_len (empty: all can).

    Every variant computes softmax(q k^T / sqrt(D)) v with no mask of its own; a model whose
    layers scale otherwise, soft-cap their logits or attend within a window shorter than N
    would be silently changed, so those cases are declared unsupported here.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    reasons = []
    scalings = {float(m.scaling) for m in model.modules()
                if isinstance(getattr(m, "scaling", None), (int, float))}
    odd = sorted(s for s in scalings if not math.isclose(s, head_dim ** -0.5, rel_tol=1e-6))
    if odd:
        reasons.append(f"the model's attention scales by {odd[0]:g}, not 1/sqrt(D) = "
                       f"{head_dim ** -0.5:g}; the variants assume 1/sqrt(D)")
    for attr in ("attn_logit_softcapping", "attn_softcap"):
        if getattr(cfg, attr, None):
            reasons.append(f"the model soft-caps its attention logits ({attr}); not supported")
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, int) and window < seq_len:
        reasons.append(f"the model's own attention is a sliding window of {window} < N; "
                       "its mask is not supported")
    limit = getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        reasons.append(f"N={seq_len} exceeds the model's {limit} positions")
    return reasons
