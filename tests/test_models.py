"""Synthetic checkpoints and the official loading path: build, load, generate through qwen-tts itself."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qwen3tts_agent.errors import ModelLoadError
from qwen3tts_agent.models import (
    SYNTHETIC_SPECS,
    ensure_synthetic_checkpoint,
    import_qwen_tts,
    load_official_model,
    parse_synthetic_spec,
    synthetic_configs,
)

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
# The talker greedy; the official sub-talker (the code predictor) still samples by default, so each test seeds
# PyTorch's generator (`_seeded`): otherwise its draws depend on the files an xdist worker ran before this one.
GREEDY = {"max_new_tokens": 12, "do_sample": False}
# Official generate yields max_new_tokens - 1 frames when there is no EOS (never, on synthetic models).
FRAMES = 11


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny(synthetic_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """``tiny(spec)``: the tiny checkpoint loaded once, through the folder branch of the loader."""
    loaded: dict[str, Any] = {}

    def get(spec: str) -> Any:
        if spec not in loaded:
            loaded[spec] = load_official_model(str(synthetic_dir(spec)), progress=False)
        return loaded[spec]

    return get


def _reference() -> tuple[np.ndarray, int]:
    """3 s of a voiced-like sound: a few harmonics of 140 Hz plus noise."""
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    wav = sum(0.2 / k * np.sin(2 * np.pi * 140 * k * t) for k in range(1, 5))
    wav += 0.01 * np.random.default_rng(0).standard_normal(t.size)
    return wav.astype(np.float32), SAMPLE_RATE


def _assert_audible(wav: np.ndarray, frames: int, tolerance: int = 0) -> None:
    assert abs(wav.shape[0] - frames * SAMPLES_PER_FRAME) <= tolerance
    assert np.isfinite(wav).all()
    assert 0.05 < np.abs(wav).max() < 0.99  # audible, not clipped at the decoder's clamp
    assert np.sqrt(np.mean(wav**2)) > 0.005


def _files(folder: Path) -> dict[Path, bytes]:
    return {
        path.relative_to(folder): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()
    }


# --- Specs --------------------------------------------------------------------------------------------


def test_every_listed_spec_parses() -> None:
    parsed = [parse_synthetic_spec(spec) for spec in SYNTHETIC_SPECS]
    assert ("tiny", "base") in parsed and ("1.7b", "voice_design") in parsed
    assert (
        parse_synthetic_spec("synthetic:tiny-base")
        == parse_synthetic_spec("synthetic:tiny")
        == ("tiny", "base")
    )
    assert parse_synthetic_spec("synthetic:0.6B-CustomVoice") == ("0.6b", "custom_voice")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic:0.6b-voicedesign", "no 0.6B VoiceDesign"),
        ("synthetic:huge", "Unknown synthetic spec"),
        ("synthetic:tiny-clone", "Unknown synthetic spec"),
        ("synthetic:", "Unknown synthetic spec"),
        ("tiny", "not a synthetic spec"),
    ],
)
def test_bad_specs_raise_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        parse_synthetic_spec(spec)


def test_loader_rejects_a_bad_synthetic_spec() -> None:
    with pytest.raises(ModelLoadError, match="synthetic:tiny-customvoice"):
        load_official_model("synthetic:0.5b")


# --- Building -----------------------------------------------------------------------------------------


def test_same_spec_gives_the_same_bytes_even_when_built_concurrently(tmp_path: Path) -> None:
    first = ensure_synthetic_checkpoint("synthetic:tiny", tmp_path / "a", progress=False)
    racing: list[Path] = []
    builders = [
        threading.Thread(
            target=lambda: racing.append(
                ensure_synthetic_checkpoint("synthetic:tiny-base", tmp_path / "b", progress=False)
            )
        )
        for _ in range(2)
    ]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(racing) == 2 and racing[0] == racing[1]
    assert [p.name for p in (tmp_path / "b").iterdir()] == [racing[0].name]  # no staging folder left behind
    assert _files(first) == _files(racing[0])

    other = ensure_synthetic_checkpoint("synthetic:tiny-customvoice", tmp_path / "a", progress=False)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_checkpoint_has_the_official_layout(synthetic_dir: Callable[[str], Path]) -> None:
    folder = synthetic_dir("synthetic:tiny")
    names = {str(path) for path in _files(folder)}
    assert names == {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "model.safetensors",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/preprocessor_config.json",
        "speech_tokenizer/model.safetensors",
    }


@pytest.mark.parametrize(
    ("spec", "talker_heads", "predictor_heads", "projection"),
    [
        # (head_dim, query heads, key-value heads): widths that are not powers of two, GQA 5:1 and 3:1, a
        # predictor as wide as the talker; and one predictor head wider than the Triton kernels take
        ("synthetic:odd", (24, 5, 1), (40, 3, 1), torch.nn.Identity),
        ("synthetic:odd-customvoice", (24, 5, 1), (40, 3, 1), torch.nn.Identity),
        ("synthetic:odd-voicedesign", (24, 5, 1), (40, 3, 1), torch.nn.Identity),
        ("synthetic:widehead", (16, 4, 2), (272, 2, 1), torch.nn.Linear),
    ],
)
def test_shape_specs_have_their_odd_shapes(
    spec: str, talker_heads: tuple[int, int, int], predictor_heads: tuple[int, int, int], projection: type
) -> None:
    import_qwen_tts()
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    model_config, _ = synthetic_configs(spec)
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**model_config))
    for layer, (head_dim, heads, kv_heads) in (
        (model.talker.model.layers[0].self_attn, talker_heads),
        (model.talker.code_predictor.model.layers[0].self_attn, predictor_heads),
    ):
        assert (layer.head_dim, layer.q_proj.out_features // layer.head_dim, layer.k_proj.out_features // layer.head_dim) == (
            head_dim, heads, kv_heads,
        )
    assert isinstance(model.talker.code_predictor.small_to_mtp_projection, projection)
    assert model_config["dtype"] == "float32"


@pytest.mark.parametrize(
    ("spec", "total", "layers", "predictor", "speaker_encoder", "projection"),
    [
        ("synthetic:0.6b", 914.6, 440.5, 141.6, 8.9, torch.nn.Identity),
        ("synthetic:0.6b-customvoice", 905.8, 440.5, 141.6, None, torch.nn.Identity),
        ("synthetic:1.7b", 1928.7, 1409.4, 175.1, 12.0, torch.nn.Linear),
        ("synthetic:1.7b-voicedesign", 1916.7, 1409.4, 175.1, None, torch.nn.Linear),
    ],
)
def test_big_specs_have_the_real_shapes(
    spec: str, total: float, layers: float, predictor: float, speaker_encoder: float | None, projection: type
) -> None:
    """Parameter counts (millions) of the released checkpoints, from configs alone (meta device, no memory)."""
    import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    model_config, codec_config = synthetic_configs(spec)
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**model_config))
        codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**codec_config))

    def millions(module: torch.nn.Module | None) -> float | None:
        return None if module is None else round(sum(p.numel() for p in module.parameters()) / 1e6, 1)

    talker = model.talker
    assert millions(model) == total
    assert millions(talker.model.layers) == layers
    assert millions(talker.model.text_embedding) == 311.2
    assert millions(talker.code_predictor) == predictor
    assert millions(model.speaker_encoder) == speaker_encoder
    assert isinstance(talker.code_predictor.small_to_mtp_projection, projection)
    assert (millions(codec), millions(codec.decoder)) == (153.7, 114.3)
    assert codec_config["decoder_config"]["sliding_window"] == 72
    assert model_config["talker_config"]["rope_scaling"] == {
        "rope_type": "default",
        "mrope_section": [24, 20, 20],
        "interleaved": True,
    }


# --- Loading and generating through the official API ---------------------------------------------------


def test_prompt_tokens_and_official_slicing(tiny: Callable[[str], Any]) -> None:
    processor = tiny("synthetic:tiny").processor
    ids = processor(text="<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"][0]
    assert ids[:3] == [151644, 77091, 198]  # <|im_start|> assistant \n
    assert ids[3:-5] == processor(text="Hello")["input_ids"][0] == [9707]
    assert ids[-5:] == [151645, 198, 151644, 77091, 198]
    assert processor(text="<tts_pad><tts_text_bos><tts_text_eod>")["input_ids"][0] == [151671, 151672, 151673]


def test_models_load_in_eval_mode_with_the_real_ids(tiny: Callable[[str], Any]) -> None:
    model = tiny("synthetic:tiny")
    assert not model.model.training and not model.model.speech_tokenizer.model.training
    assert model.model.dtype == torch.float32 and model.model.tts_model_type == "base"
    assert "english" in model.get_supported_languages() and "auto" in model.get_supported_languages()
    assert {"ryan", "vivian", "serena", "dylan", "eric"} <= set(
        tiny("synthetic:tiny-customvoice").get_supported_speakers()
    )


@pytest.mark.parametrize("x_vector_only", [True, False], ids=["x-vector", "icl"])
def test_voice_clone(tiny: Callable[[str], Any], x_vector_only: bool) -> None:
    model = tiny("synthetic:tiny")
    prompt = model.create_voice_clone_prompt(
        _reference(), ref_text="A short reference sentence.", x_vector_only_mode=x_vector_only
    )
    assert prompt[0].ref_spk_embedding.shape == (64,)
    if not x_vector_only:
        codes = prompt[0].ref_code
        assert codes.shape == (38, 16) and int(codes.min()) >= 0 and int(codes.max()) < 2048  # 3 s at 12.5 Hz
    wavs, sample_rate = model.generate_voice_clone(
        "Hello there, this is a test.", language="English", voice_clone_prompt=prompt, **GREEDY
    )
    assert sample_rate == SAMPLE_RATE
    # ICL decodes reference + new codes together, then cuts the reference part off in proportion.
    _assert_audible(wavs[0], FRAMES, tolerance=0 if x_vector_only else 1)


def test_custom_voice_batch_with_a_dialect_speaker(tiny: Callable[[str], Any]) -> None:
    wavs, _ = tiny("synthetic:tiny-customvoice").generate_custom_voice(
        ["Hello there.", "你好，今天天气很好。"],
        speaker=["Ryan", "eric"],
        language=["English", "Chinese"],
        **GREEDY,
    )
    for wav in wavs:
        _assert_audible(wav, FRAMES)


def test_voice_design(tiny: Callable[[str], Any]) -> None:
    wavs, _ = tiny("synthetic:tiny-voicedesign").generate_voice_design(
        "Hello there.", instruct="A calm, low voice.", language="Auto", **GREEDY
    )
    _assert_audible(wavs[0], FRAMES)


def test_loader_builds_a_spec_into_the_given_cache(tmp_path: Path) -> None:
    model = load_official_model("synthetic:tiny-voicedesign", cache_dir=tmp_path, progress=False)
    assert model.model.tts_model_type == "voice_design"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-voicedesign-v1"]


# --- Failures -------------------------------------------------------------------------------------------


def test_missing_or_foreign_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_official_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_official_model(str(tmp_path))


@pytest.mark.parametrize("offline", [False, True], ids=["unreachable", "HF_HUB_OFFLINE"])
def test_uncached_hub_id_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, offline: bool) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match="synthetic:tiny") as error:
        load_official_model("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    assert time.perf_counter() - started < 5
    assert ("HF_HUB_OFFLINE" in str(error.value)) == offline


def test_torchaudio_stand_in_explains_itself() -> None:
    import_qwen_tts()
    import torchaudio

    if torchaudio.__spec__.origin is not None:
        pytest.skip("a real torchaudio is installed")
    with pytest.raises(RuntimeError, match="25 Hz"):
        torchaudio.compliance.kaldi.fbank(torch.zeros(1, 16000))


def test_official_import_is_quiet_without_sox_or_flash_attn(tmp_path: Path) -> None:
    """The unused 25 Hz tokenizer's notices (SoX binary missing, flash-attn missing) stay out of our output."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(root)}  # no sox binary on PATH

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)

    # the plain import, for comparison: the notices this machine would show
    raw = run("from qwen3tts_agent.models import compat; compat._register_torchaudio_stand_in(); import qwen_tts")
    assert raw.returncode == 0, raw.stderr
    assert "SoX could not be found" in raw.stderr and "flash-attn" in raw.stdout
    quiet = run("from qwen3tts_agent.models import import_qwen_tts; import_qwen_tts(); print('imported')")
    assert quiet.returncode == 0, quiet.stderr
    assert (quiet.stdout, quiet.stderr) == ("imported\n", "")


def test_the_engine_core_loads_a_model_without_importing_scikit_learn() -> None:
    """transformers imports scikit-learn with its generation code, for assisted generation only; the engine
    core tells it not to. The model still loads and generates through the official classes."""
    code = (
        "import sys\n"
        "from qwen3tts_agent.models import compat, load_official_model\n"
        "{switch}"
        "model = load_official_model('synthetic:tiny', device='cpu', progress=False)\n"
        "wavs, _ = model.generate_voice_clone('Hi.', ref_audio=(__import__('numpy').zeros(24000, 'float32') + 0.1, 24000),\n"
        "                                     x_vector_only_mode=True, max_new_tokens=3)\n"
        "assert wavs[0].size > 0\n"
        "print('sklearn' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]

    def sklearn_imported(switch: str) -> bool:
        result = subprocess.run([sys.executable, "-c", code.format(switch=switch)], env={**os.environ, "PYTHONPATH": str(root)},
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.strip().splitlines()[-1] == "True"

    assert sklearn_imported("")  # as transformers does by default, with scikit-learn installed
    assert not sklearn_imported("compat.transformers_without_scikit_learn()\n")
