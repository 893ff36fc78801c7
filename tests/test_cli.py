"""The `jaxllm` command line as a user runs it: in a subprocess, on a tiny random model and on the
default model, plus in-process checks of the chat history and the error paths.

Each subprocess pays the jax import (~3 s), so there are few of them.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jaxllm
from jaxllm import cli
import jaxllm.cli.common
from jaxllm.cli.generate import stop_ids
from jaxllm.io import paths

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random Llama with its own byte-level BPE tokenizer and a ChatML template."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("tiny_chat_model")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["hello world, what is the capital of France? Paris. 2+2=4, ok"] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>", chat_template=CHATML)
    fast.save_pretrained(out)
    config = transformers.LlamaConfig(
        vocab_size=tk.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
        eos_token_id=tk.token_to_id("<|im_end|>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def run_cli(*args: str, stdin: str = "", entry: str = "module", timeout: int = 300):
    """Run the CLI as a user would: `python -m jaxllm` or the installed `jaxllm` script."""
    if entry == "script":
        script = shutil.which("jaxllm", path=str(Path(sys.executable).parent)) or shutil.which("jaxllm")
        assert script, "the `jaxllm` console script is not installed"
        cmd = [script, *args]
    else:
        cmd = [sys.executable, "-m", "jaxllm", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_help_lists_the_subcommands():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout and "chat" in r.stdout and "serve" in r.stdout


@pytest.mark.slow
def test_generate_streams_the_greedy_answer(tiny_model):
    r = run_cli("generate", "hello world", "--model", str(tiny_model), "--max-new-tokens", "12",
                "--dtype", "float32", entry="script")
    assert r.returncode == 0, r.stderr

    # The same answer through the Python API: chat template, greedy, stop token not shown.
    params = jaxllm.load(tiny_model, dtype="float32")
    tok = jaxllm.load_tokenizer(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    ids = tok.encode(text)
    stops = stop_ids(params, tok)
    out = jaxllm.generate(params, [ids], max_new_tokens=12, eos_token_ids=stops)
    new = [int(t) for t in out.tokens[0, :int(out.lengths[0])] if int(t) not in stops]
    assert new, "the tiny model stopped at once: the test would compare nothing"
    assert r.stdout == tok.decode(new) + "\n"


@pytest.mark.slow
def test_bad_flag_value_is_one_line_and_exit_2(tiny_model):
    r = run_cli("generate", "hi", "--model", str(tiny_model), "--top-p", "2")
    assert r.returncode == 2
    assert "top_p must be in (0, 1]" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["chat", "--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["generate", "hi", "--model", "/nonexistent/model"], "no model at /nonexistent/model"),
])
def test_bad_input_exits_2_with_the_reason(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["roofline", "tiny", "--peak-bw", "0"], "peak_bw must be a positive, finite rate, got 0.0"),
    (["roofline", "tiny", "--peak-flops", "nan"], "peak_flops must be a positive, finite rate, got nan"),
    (["roofline", "tiny", "--context", "-5"], "argument --context: must be in [0, 2147483647] (int32), got -5"),
    (["roofline", "tiny", "--dtype", "int32"], "dtype must be bfloat16, float16, float32 or int8, got int32"),
    (["generate", "hi", "--seed", str(2 ** 63)], "seed must be at most 9223372036854775807"),
    (["serve", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["serve", "--max-queued", "0"], "argument --max-queued: must be >= 1, got 0"),
    (["serve", "--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a number of seconds >= 0"),
    (["serve", "--prefill-chunk", "100"], "--prefill-chunk must be a power of two >= 16 or a multiple of 1024"),
    (["serve", "--num-speculative", "3"], "--num-speculative needs --speculate ngram or --draft-model"),
    (["serve", "--speculate", "ngram", "--draft-model", "d.gguf"], "give --speculate ngram or --draft-model, not both"),
    (["serve", "--draft-model", "/nonexistent/draft"], "no draft model at /nonexistent/draft"),
    (["serve", "--draft-quant", "int8"], "--draft-quant needs --draft-model"),
    (["serve", "--speculate", "ngram", "--num-speculative", "0"], "argument --num-speculative: must be in [1, 32], got 0"),
    (["serve", "--model", "/nonexistent/model"], "no model at /nonexistent/model"),
])
def test_bad_numbers_exit_2_with_the_reason(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:  # refused by argparse itself, as the flag is read
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "hi", "--trace-dir", "{file}"], ["convert", "{file}"]])
def test_a_directory_flag_given_a_file_exits_2(argv, tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("kept")
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(file=file) for a in argv])
    assert e.value.code == 2
    assert f"{file} exists and is not a directory" in capsys.readouterr().err
    assert file.read_text() == "kept"


@pytest.mark.parametrize("argv", [["generate", "hi", "--trace-dir", "{file}/sub"], ["convert", "{file}/sub"],
                                  ["convert", "SRC", "{file}/a/b"], ["chat", "--trace-dir", "{file}/sub"]])
def test_a_directory_flag_under_a_file_exits_2(argv, tmp_path, capsys):
    """Refused as the flag is read, one line naming the path: not a NotADirectoryError traceback
    from the trace or checkpoint writer after the model has loaded."""
    file = tmp_path / "notes.txt"
    file.write_text("kept")
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(file=file) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot be made: {file} is not a directory" in err
    assert "Traceback" not in err
    assert file.read_text() == "kept"


def test_a_model_whose_config_json_is_a_directory_exits_2(tiny_model, tmp_path, capsys):
    """Named as it is, not as `config.json/config.json not found`."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert cli.main(["generate", "hi", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"{model / 'config.json'} is not a file" in err
    assert "config.json/config.json" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--max-new-tokens", "0"])
    assert e.value.code == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_missing_default_model_gives_the_install_hint(monkeypatch, capsys):
    monkeypatch.setattr(paths, "DEFAULT_PACKAGE", "jaxllm_no_such_package")
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert paths.INSTALL_HINT in err
    assert "Traceback" not in err


def test_chat_keeps_history_and_reset_clears_it(tiny_model, monkeypatch, capsys):
    """Each turn re-renders the whole history; /reset forgets it; /exit ends before later lines."""
    tok = jaxllm.load_tokenizer(tiny_model)
    answer = tok.encode(" Paris ok")
    prompts = []

    def fake_stream(params, ids, *, eos_token_ids, **kwargs):  # the model's part is tested above
        prompts.append(tok.decode(ids))
        yield from answer
        yield eos_token_ids[0]

    monkeypatch.setattr(jaxllm, "stream", fake_stream)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand France?\n/reset\nagain\n/exit\nnever sent\n"))
    assert cli.main(["chat", "--model", str(tiny_model)]) == 0
    assert capsys.readouterr().out == " Paris ok\n" * 3
    assert len(prompts) == 3
    first, second, third = prompts
    assert "hi" in first
    assert second.startswith(first + " Paris ok")  # the first turn, the answer included
    assert "and France?" in second
    assert "again" in third and "hi" not in third and "Paris" not in third


def test_trace_dir_writes_a_trace_of_the_decode_steps(tiny_model, tmp_path, capsys):
    argv = ["generate", "hello", "--model", str(tiny_model), "--dtype", "float32", "--max-new-tokens", "6",
            "--trace-dir", str(tmp_path / "trace")]
    assert cli.main(argv) == 0
    assert list((tmp_path / "trace").rglob("*.xplane.pb")), "no trace written"
    err = capsys.readouterr().err
    assert str(tmp_path / "trace") in err
    # The summary read back from the trace: real ops of the decode steps, with their shares.
    assert "by phase: decode" in err and "layer_0/" in err


@pytest.mark.slow
def test_default_model_generate_and_chat():
    """The default model answers through both commands, the same way for the same first message.

    The second process reuses the first one's compiled programs (persistent compile cache).
    """
    r = run_cli("generate", "What is 2+2?", "--max-new-tokens", "8", entry="script")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr

    c = run_cli("chat", "--max-new-tokens", "8", stdin="What is 2+2?\n/exit\nnever sent\n")
    assert c.returncode == 0, c.stderr
    assert "Traceback" not in c.stderr
    assert c.stdout == r.stdout


def test_roofline_subcommand(capsys):
    from jaxllm.cli import main
    assert main(["roofline", "smollm2-135m", "--batch", "1", "--context", "128"]) == 0
    out = capsys.readouterr().out
    assert "gate_up" in out and "lm_head" in out and "step >=" in out


def test_gguf_of_an_unsupported_architecture_is_one_line_and_no_converting(tmp_path, monkeypatch, capsys):
    """The file is checked before "converting ... once" is announced: nothing will be converted."""
    from test_gguf import write_tiny

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "fancy.gguf"
    write_tiny(path, "fancyarch")
    assert cli.main(["generate", "hi", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "GGUF architecture 'fancyarch' is not supported" in err
    assert "converting" not in err
    assert len(err.strip().splitlines()) == 1


def test_gguf_tensor_of_an_unsupported_type_is_named_before_converting(tmp_path, monkeypatch, capsys):
    from test_gguf import write_f64_tensor_file

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "f64.gguf"
    write_f64_tensor_file(path)
    assert cli.main(["generate", "hi", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tensor 'blk.1.attn_v.weight' is stored as F64" in err
    assert "converting" not in err


def test_gguf_conversion_is_announced_before_loading_and_not_once_cached(tmp_path, monkeypatch, capsys):
    from test_gguf import write_tiny

    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama")
    announced = []

    def load(*args, **kwargs):  # the slow part: announced by then
        announced.append("converting tiny.gguf once" in capsys.readouterr().err)
        raise ValueError("stop")
    monkeypatch.setattr(jaxllm, "load", load)
    assert cli.main(["generate", "hi", "--model", str(path), "--dtype", "float32"]) == 2
    assert announced == [True]
    monkeypatch.undo()
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    jaxllm.load(path, dtype="float32")  # converts and caches
    capsys.readouterr()
    cli.common._note_conversion(path, "float32")
    assert "converting" not in capsys.readouterr().err
