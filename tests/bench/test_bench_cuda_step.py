"""bench/cuda_step.py on the CPU with its tiny shape: the table and the JSON it writes."""
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # last: bench/tokenizers.py must not hide the tokenizers package
import cuda_step  # noqa: E402


def test_tiny_shape_on_cpu_writes_steps_and_codec_rows(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert cuda_step.main(["--device", "cpu", "--shapes", "tiny", "--steps", "2", "--warmup", "1",
                           "--codecs", "sparseloco", "--codec-repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    text = json.dumps(data)
    assert "tokens_per_s" in text and "sparseloco" in text
    assert "tokens/s" in capsys.readouterr().out
