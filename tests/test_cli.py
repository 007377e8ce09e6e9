"""`minivllm generate` works on a given model and, with no --model and no SmolLM2 installed,
on the built-in demo model (test_smollm2.py runs it with SmolLM2)."""

import pytest

from minivllm.entrypoints.cli import main


def test_generate_with_model(tiny_model_factory, capsys: pytest.CaptureFixture) -> None:
    model_dir = tiny_model_factory("Qwen3ForCausalLM")
    main(["generate", "--model", model_dir, "--prompt", "Hello", "--max-tokens", "5", "--ignore-eos",
          "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "Prompt: 'Hello'" in out and "(5 tokens, finish_reason=length)" in out


def test_generate_demo_model(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("minivllm.local_models.smollm2_path", lambda: None)
    main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos", "--chat"])
    captured = capsys.readouterr()
    assert "RANDOM weights" in captured.err
    assert "(3 tokens, finish_reason=length)" in captured.out


def test_bad_input_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
