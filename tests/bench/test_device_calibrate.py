"""The H200 calibration script, checked without a GPU: the model directory it writes, the vLLM
command it builds (parsed by the installed vLLM's own parser), a dry run, and its client against a
running simulated replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.services import require_module
from tidal.bench.device.calibrate_h200 import SHAPES, main, model_config, vllm_command, write_model_dir
from tidal.replicas.launcher import sim_process


@pytest.mark.parametrize("key", ["8b", "70b-fp8"])
def test_the_model_directory_has_the_presets_shape_and_a_local_tokenizer(key: str, tmp_path: Path) -> None:
    shape = SHAPES[key]
    d = write_model_dir(shape, tmp_path / key)
    cfg = json.loads((d / "config.json").read_text())
    m = shape.spec
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        m.num_layers,
        m.hidden_size,
        m.intermediate_size,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
    )
    assert cfg["vocab_size"] == 128256 and not cfg["tie_word_embeddings"]
    # FP8 weights are declared as an FP8 checkpoint; the 8B stays BF16
    assert ("quantization_config" in cfg) == shape.fp8_weights
    assert not list(d.glob("*.safetensors"))  # no weights: vLLM's dummy loader makes them
    require_module("transformers", "install the `vllm` extra: scripts/setup")
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(d).num_key_value_heads == m.num_kv_heads
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 128256
    assert tok.encode("t5 t127999", add_special_tokens=False) == [5, 127999]
    assert tok.decode([7, 8]) == "t7 t8"


# Importing vLLM's parser imports torch, whose TorchScript shims warn on import.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.*")
def test_the_vllm_command_parses_with_vllms_own_parser(tmp_path: Path) -> None:
    require_module("vllm", "install the `vllm` extra: scripts/setup")
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # older vLLM
        from vllm.entrypoints.openai.cli_args import make_arg_parser  # type: ignore[no-redef]
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    shape = SHAPES["70b-fp8"]
    cmd = vllm_command(shape, tmp_path / "m", 8123, "vllm")
    assert cmd[:2] == ["vllm", "serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[2:])
    assert args.model_tag == str(tmp_path / "m") and args.tokenizer == str(tmp_path / "m")
    assert args.load_format == "dummy" and args.tensor_parallel_size == 1
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (1024, 8192, 8192)
    assert args.gpu_memory_utilization == 0.9 and args.port == 8123
    # the config's quantization section is an FP8 checkpoint to vLLM (FP8 weights allocated)
    q = Fp8Config.from_config(model_config(shape)["quantization_config"])
    assert q.is_checkpoint_fp8_serialized and q.activation_scheme == "dynamic"


def test_a_dry_run_writes_the_published_and_simulated_figures(tmp_path: Path) -> None:
    assert (
        main(["--dry-run", "--quick", "--shapes", "8b", "--out", str(tmp_path), "--workdir", str(tmp_path)])
        == 0
    )
    (result,) = tmp_path.glob("calibration-dry-run-*.json")
    rows = {r["point"]: r for r in json.loads(result.read_text())["rows"]}
    latency = rows["latency bs8 32/128 (e2e ms)"]
    assert latency["published"] == 833.4 and latency["measured"] is None
    # the simulator's own calibration keeps this point within 15% of the published figure
    assert latency["simulated"] == pytest.approx(833.4, rel=0.15)
    assert rows["throughput 200 ShareGPT-shaped (req/s)"]["simulated"] == pytest.approx(22.6, rel=0.15)
    assert (
        rows["closed-loop c=16 2000/200: itl_ms"]["simulated"]
        > rows["closed-loop c=1 2000/200: itl_ms"]["simulated"]
    )


def test_the_points_run_against_a_running_server(tmp_path: Path) -> None:
    # Given a simulated replica speaking vLLM's OpenAI API (about 1 ms steps)
    proc = sim_process("fast-test", name="device-target", log_path=tmp_path / "sim.log")
    proc.start()
    try:
        proc.wait_ready(60)
        # When the script measures its points against it
        assert (
            main(
                [
                    "--target",
                    proc.url,
                    "--quick",
                    "--shapes",
                    "8b",
                    "--out",
                    str(tmp_path),
                    "--workdir",
                    str(tmp_path),
                ]
            )
            == 0
        )
    finally:
        proc.stop()
    (result,) = tmp_path.glob("calibration-target-*.json")
    rows = json.loads(result.read_text())["rows"]
    # Then every point has a measured figure beside the simulated one
    assert all(r["measured"] and r["measured"] > 0 for r in rows)
    byname = {r["point"]: r["measured"] for r in rows}
    assert (
        byname["closed-loop c=16 2000/200: output_tok_s"] > byname["closed-loop c=1 2000/200: output_tok_s"]
    )
