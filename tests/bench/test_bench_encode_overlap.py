"""bench/encode_overlap.py on the CPU with its tiny shape: both CPU modes, the same payload in each."""
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # last: bench/tokenizers.py must not hide the tokenizers package
import encode_overlap  # noqa: E402


def test_tiny_shape_on_cpu_times_the_encode_alone_and_beside_training(capsys):
    assert encode_overlap.main(["--device", "cpu", "--shape", "tiny", "--repeats", "1", "--steps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "alone" in out and "beside training" in out and "own stream" not in out  # no CUDA here
    assert "NO" not in out.split("same payload")[1]  # the payload does not depend on what runs beside it
