"""`meshnode models ...` end to end through meshnode.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnode.cli import main
from meshnode.cli.models import parse_range
from meshnode.models.gguf_info import open_gguf


@pytest.mark.slow
def test_list_info_slice(smollm2, model_store_paths, test_model_cache, tmp_path: Path, capsys):
    home = str(test_model_cache / "home")
    assert main(["models", "list", "--home", home, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert smollm2.name in [m["name"] for m in listed]

    assert main(["models", "info", smollm2.name, "--home", home, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["architecture"], info["n_layers"], info["file_type"]) == ("llama", 30, "MOSTLY_Q4_1")

    out = tmp_path / "mid.gguf"
    assert main(["models", "slice", smollm2.name, "--range", "10:15", "-o", str(out), "--home", home]) == 0
    assert "middle stage" in capsys.readouterr().out
    assert open_gguf(out).fields["llama.block_count"].contents() == 5


def test_user_errors_are_one_line(tmp_path: Path, synthetic_gguf, capsys):
    home = str(tmp_path / "home")
    src = synthetic_gguf(n_layer=4)
    out = tmp_path / "s.gguf"
    assert main(["models", "slice", str(src), "--range", "2:9", "-o", str(out), "--home", home]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshnode: error: layer range [2, 9)") and "Traceback" not in err
    assert not out.exists()
    assert main(["models", "slice", str(src), "--range", "2-3", "-o", str(out), "--home", home]) == 2
    assert "A:B" in capsys.readouterr().err
    assert main(["models", "info", "no-such-model", "--home", home]) == 2
    assert "no model 'no-such-model'" in capsys.readouterr().err
    mamba = synthetic_gguf("m.gguf", architecture="mamba")
    assert main(["models", "slice", str(mamba), "--range", "1:2", "-o", str(out), "--home", home]) == 2
    assert "architecture 'mamba' is not supported for splitting" in capsys.readouterr().err
    # an output that is a folder, or where no file can be made
    assert main(["models", "slice", str(src), "--range", "1:2", "-o", str(tmp_path), "--home", home]) == 2
    assert f"-o {tmp_path}: a directory" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert main(["models", "slice", str(src), "--range", "1:2", "-o", str(blocked / "s.gguf"), "--home", home]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshnode: error: cannot write {blocked / 's.gguf'}") and "Traceback" not in err


def test_a_home_that_is_a_file_is_one_line(tmp_path: Path, meshnode_main):
    home = tmp_path / "home"
    home.write_text("not a folder")
    for argv in (("status",), ("invite",), ("models", "list")):
        r = meshnode_main("--home", str(home), *argv)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"home {home}: not a directory" in r.stderr


def test_parse_range():
    assert parse_range("0:10") == (0, 10)


def test_quantize_writes_a_store_model(tmp_path: Path, synthetic_gguf, meshnode_main):
    home = str(tmp_path / "home")
    src = synthetic_gguf("tiny-f32.gguf", n_layer=2)
    r = meshnode_main("models", "quantize", str(src), "q8_0", "--home", home, "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "tiny-q8_0: tiny-f32 quantized to Q8_0" in r.stdout
    assert "meshnode --model tiny-q8_0" in r.stdout
    r = meshnode_main("models", "info", "tiny-q8_0", "--home", home, "--json")
    info = json.loads(r.stdout)
    assert (info["file_type"], info["n_layers"]) == ("MOSTLY_Q8_0", 2)
    assert info["size"] < src.stat().st_size / 2          # 8.5 bits a weight against 32
    r = meshnode_main("models", "list", "--home", home, "--json")
    assert [m["name"] for m in json.loads(r.stdout)] == ["tiny-q8_0"]

    # the same name again: refused, the first copy kept
    before = Path(info["path"]).read_bytes()
    r = meshnode_main("models", "quantize", str(src), "Q8_0", "--home", home)
    assert r.returncode == 2 and "tiny-q8_0 is already in the store" in r.stderr
    assert Path(info["path"]).read_bytes() == before
    # a name of its own works
    r = meshnode_main("models", "quantize", "tiny-q8_0", "q4_0", "--name", "tiny.small", "--home", home)
    assert r.returncode == 0, r.stderr
    r = meshnode_main("models", "info", "tiny.small", "--home", home, "--json")
    assert json.loads(r.stdout)["file_type"] == "MOSTLY_Q4_0"


def test_quantize_user_errors(tmp_path: Path, synthetic_gguf, meshnode_main):
    home = str(tmp_path / "home")
    src = synthetic_gguf(n_layer=2)
    r = meshnode_main("models", "quantize", str(src), "Q9_X", "--home", home)
    assert r.returncode == 2 and "unknown quantization type 'Q9_X'; choose one of Q4_0" in r.stderr
    for bad in ("../up", ".hidden", "a/b", ""):
        r = meshnode_main("models", "quantize", str(src), "q8_0", "--name", bad, "--home", home)
        assert r.returncode == 2 and "--name" in r.stderr and "Traceback" not in r.stderr, bad
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"not a model at all" * 10)
    r = meshnode_main("models", "quantize", str(notgguf), "q8_0", "--home", home)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.gguf"))


def test_quantize_reports_each_tensor(tmp_path: Path, synthetic_gguf):
    from meshnode.engine.quantize import requantize
    from meshnode.models.gguf_info import read_model_info

    src = synthetic_gguf(n_layer=2)
    info = read_model_info(src)
    n_tensors = len(info.other_tensors) + sum(len(b) for b in info.blocks)
    seen: list[tuple[int, int]] = []
    requantize(src, tmp_path / "q.gguf", "Q8_0", progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, n_tensors) for i in range(n_tensors)]


@pytest.mark.parametrize("name, ftype, want", [
    ("smollm2-135m-instruct-q4_1", "Q4_0", "smollm2-135m-instruct-q4_0"),
    ("SmolLM2-135M-Instruct.Q4_1", "Q8_0", "SmolLM2-135M-Instruct-q8_0"),
    ("gemma-3-270m-q4_k_m", "Q8_0", "gemma-3-270m-q8_0"),
    ("llama-f16", "Q4_K_M", "llama-q4_k_m"),
    ("mymodel", "Q4_0", "mymodel-q4_0"),
    ("q4_0", "Q8_0", "q4_0-q8_0"),
])
def test_derived_name(name, ftype, want):
    from meshnode.cli.models import derived_name

    assert derived_name(name, ftype) == want


@pytest.mark.slow
def test_quantize_answers_ctrl_c(tmp_path: Path, synthetic_gguf):
    """A real `meshnode models quantize` process, interrupted while llama.cpp quantizes:
    it stops at once and leaves nothing in the store."""
    import signal
    import subprocess
    import time

    from meshnode.paths import NodePaths
    from tests.nodeproc import env, meshnode_argv

    # ~360 MB of f32 weights: seconds of Q4_K_M work on one thread
    src = synthetic_gguf("big-f32.gguf", n_layer=6, n_embd=1024, n_head=16, n_kv_head=4, n_ff=4096, vocab=4096)
    home = tmp_path / "home"
    folder = NodePaths.resolve(str(home)).models / "big-q4_k_m"
    proc = subprocess.Popen(meshnode_argv("models", "quantize", str(src), "Q4_K_M", "--threads", "1",
                                          "--home", str(home)),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as a terminal starts it: a runner that started the tests in
                            # the background passes SIGINT on ignored, and Python then
                            # keeps ignoring it (as it should: Ctrl-C is not meant for it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not folder.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert folder.exists() and proc.poll() is None, "quantizing did not start"
        time.sleep(0.5)
        assert proc.poll() is None, "quantizing ended before it could be interrupted"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 5
    assert "quantize cancelled: nothing was added to the store" in err and "Traceback" not in err
    assert not folder.exists()


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path, monkeypatch, capsys):
    # `meshnode models list | head`: the pipe closes while the command still prints
    import sys

    class ClosedPipe:
        def write(self, _text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["models", "list", "--home", str(tmp_path)]) == 141
    assert "Traceback" not in capsys.readouterr().err
