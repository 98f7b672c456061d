"""What each synthetic checkpoint is made of, as data: its ids, its shapes and the config files they fill.

A checkpoint's config files fix everything about its model but the weight values: the official loader
builds the architecture from ``config.json`` and ``speech_tokenizer/config.json`` alone. This module
holds that part, apart from the machinery in ``synthetic.py`` that builds and caches the weights, so
that what a spec stands for reads in one place and ``synthetic_configs`` answers without importing
qwen-tts or writing a byte.

The ids are the released family's (text and codec special tokens, language and speaker ids, the
tokenizer's TTS control tokens), the same for every size. The size picks the shapes: the widths,
depths and head layouts of the talker, its code predictor and the Base models' ECAPA-TDNN speaker
encoder (``0.6b`` and ``1.7b`` as released; ``tiny``, ``odd`` and ``widehead`` small, see
``synthetic.py``), and the codec's (the real one for the released sizes, a narrow one with the real
rates for the small sizes). The model type changes only the config: ``custom_voice`` fills the speaker
and dialect tables, and the official model builds the speaker encoder for ``base`` only, so
CustomVoice and VoiceDesign checkpoints of a size have the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch

SIZES = ("tiny", "odd", "widehead", "0.6b", "1.7b")
_SMALL_SIZES = ("tiny", "odd", "widehead")  # fp32 weights and the tiny codec: sizes for CPU tests
# The spec spelling of each model type, and its official tts_model_type.
MODEL_TYPES = {"base": "base", "customvoice": "custom_voice", "voicedesign": "voice_design"}
_OFFICIAL_SIZE_NAMES = {"tiny": "tiny", "odd": "odd", "widehead": "widehead", "0.6b": "0b6", "1.7b": "1b7"}

_TRANSFORMERS_VERSION = "4.57.3"  # the version qwen-tts 0.1.1 pins, written as save_pretrained would

# --- Real ids (identical across the released family) -----------------------------------------------

_TEXT_IDS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
}
_CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
_LANGUAGE_IDS = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
_CUSTOM_VOICE_SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
# The official code looks every speaker up here (KeyError otherwise) and, for Chinese or Auto,
# swaps the language tag for the speaker's dialect tag.
_SPEAKER_DIALECTS: dict[str, str | bool] = {
    **{name: False for name in _CUSTOM_VOICE_SPEAKERS},
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}
# The TTS control tokens the released tokenizer adds after Qwen3's own added tokens (151643-151668).
TTS_ADDED_TOKENS = (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
FIRST_TTS_ADDED_ID = 151669

# --- Shapes ------------------------------------------------------------------------------------------

_TALKER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        text_hidden_size=32,
        mrope_section=[3, 3, 2],
    ),
    "odd": dict(
        hidden_size=120,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=24,
        text_hidden_size=32,
        mrope_section=[4, 4, 4],
    ),
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        text_hidden_size=2048,
        mrope_section=[24, 20, 20],
    ),
    "1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        text_hidden_size=2048,
        mrope_section=[24, 20, 20],
    ),
}
_TALKER_SHAPES["widehead"] = _TALKER_SHAPES["tiny"]
_REAL_PREDICTOR = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=5,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)
# Tiny's predictor is narrower than its talker so that, as on 1.7B, the small_to_mtp projection exists.
_PREDICTOR_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    ),
    "odd": dict(
        hidden_size=120,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=40,
    ),
    "widehead": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=272,
    ),
    "0.6b": _REAL_PREDICTOR,
    "1.7b": _REAL_PREDICTOR,
}
# ECAPA-TDNN; the last channel count must be 3x the others (it concatenates three blocks).
_SPEAKER_ENCODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=16
    ),
    "0.6b": dict(
        enc_channels=[512, 512, 512, 512, 1536],
        enc_attention_channels=128,
        enc_res2net_scale=8,
        enc_se_channels=128,
    ),
}
_SPEAKER_ENCODER_SHAPES["1.7b"] = _SPEAKER_ENCODER_SHAPES["0.6b"]
_SPEAKER_ENCODER_SHAPES["odd"] = _SPEAKER_ENCODER_SHAPES["widehead"] = _SPEAKER_ENCODER_SHAPES["tiny"]

# 12 Hz codec. Tiny keeps the real strides (1920 samples per frame at 24 kHz), codebook sizes,
# quantizer counts and the decoder's sliding window of 72; Mimi's upsample_groups must divide its width.
_CODEC_ENCODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        num_filters=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        upsample_groups=32,
    ),
    "real": dict(
        hidden_size=512,
        num_filters=64,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2048,
        codebook_dim=256,
        vector_quantization_hidden_dimension=256,
        upsample_groups=512,
    ),
}
_CODEC_DECODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        codebook_dim=32,
        hidden_size=32,
        head_dim=16,
        latent_dim=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        decoder_dim=64,
    ),
    "real": dict(
        codebook_dim=512,
        hidden_size=512,
        head_dim=64,
        latent_dim=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=1024,
        num_hidden_layers=8,
        decoder_dim=1536,
    ),
}

# --- Configs -----------------------------------------------------------------------------------------


def model_config(size: str, model_type: str) -> dict[str, Any]:
    """``config.json``: talker, code predictor and speaker encoder (built for Base only), real ids."""
    talker = dict(_TALKER_SHAPES[size])
    mrope_section = talker.pop("mrope_section")
    custom_voice = model_type == "custom_voice"
    talker_config = {
        **talker,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": mrope_section, "interleaved": True},
        "attention_bias": False,
        "vocab_size": 3072,
        "text_vocab_size": 151936,
        "num_code_groups": 16,
        "position_id_per_seconds": 13,
        **_CODEC_IDS,
        "codec_language_id": dict(_LANGUAGE_IDS),
        "spk_id": dict(_CUSTOM_VOICE_SPEAKERS) if custom_voice else {},
        "spk_is_dialect": dict(_SPEAKER_DIALECTS) if custom_voice else {},
        "code_predictor_config": {
            **_PREDICTOR_SHAPES[size],
            "hidden_act": "silu",
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "attention_bias": False,
            "vocab_size": 2048,
            "num_code_groups": 16,
        },
    }
    # Written by hand: save_pretrained would write "model_type": "" here, which from_pretrained rejects.
    speaker_encoder_config = {
        "mel_dim": 128,
        "enc_dim": talker["hidden_size"],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        **_SPEAKER_ENCODER_SHAPES[size],
        "sample_rate": 24000,
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": _OFFICIAL_SIZE_NAMES[size],
        "tts_model_type": model_type,
        **_TEXT_IDS,
        "assistant_token_id": 77091,
        "speaker_encoder_config": speaker_encoder_config,
        "talker_config": talker_config,
        "dtype": _dtype_name(model_dtype(size)),
        "transformers_version": _TRANSFORMERS_VERSION,
    }


def speech_tokenizer_config(size: str) -> dict[str, Any]:
    """``speech_tokenizer/config.json``: the 12 Hz codec, real rates, tiny widths for the small sizes."""
    shapes = "tiny" if size in _SMALL_SIZES else "real"
    encoder = {
        "audio_channels": 1,
        "sampling_rate": 24000,
        "frame_rate": 12.5,
        "upsampling_ratios": [8, 6, 5, 4],
        "kernel_size": 7,
        "last_kernel_size": 3,
        "residual_kernel_size": 3,
        "num_residual_layers": 1,
        "dilation_growth_rate": 2,
        "compress": 2,
        "use_causal_conv": True,
        "pad_mode": "constant",
        "trim_right_ratio": 1.0,
        "use_conv_shortcut": False,
        "num_quantizers": 32,
        "num_semantic_quantizers": 1,
        "codebook_size": 2048,
        "hidden_act": "gelu",
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 250,
        "max_position_embeddings": 8000,
        "layer_scale_initial_scale": 0.01,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": False,
        **_CODEC_ENCODER_SHAPES[shapes],
    }
    decoder = {
        "codebook_size": 2048,
        "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "rope_theta": 10000,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01,
        "attention_bias": False,
        "attention_dropout": 0.0,
        **_CODEC_DECODER_SHAPES[shapes],
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_config": encoder,
        "decoder_config": decoder,
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "dtype": "float32",
        "transformers_version": _TRANSFORMERS_VERSION,
    }


GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
}
PROCESSOR_CONFIG = {
    "padding_side": "left",
    "padding_value": 0.0,
    "processor_class": "Qwen3TTSProcessor",
    "return_attention_mask": True,
}
CODEC_FEATURE_EXTRACTOR_CONFIG = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}


def model_dtype(size: str) -> torch.dtype:
    """The dtype of ``model.safetensors`` (the talker): the small sizes are for CPU tests, in fp32."""
    # The released talker checkpoints are bf16; their speech tokenizer is fp32.
    return torch.float32 if size in _SMALL_SIZES else torch.bfloat16


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
