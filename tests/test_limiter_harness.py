"""The comparison harness: its default profile shows the fixed window's straddle leak."""

from limiter import harness


def test_harness_default_profile_shows_the_fixed_window_leak(capsys):
    assert harness.main([]) == 0
    out = capsys.readouterr().out
    assert "fixed-window" in out and "sliding-log" in out
    row = next(line for line in out.splitlines() if line.startswith("max/2s")).split()
    offered, fixed, bucket, counter, log = map(int, row[1:])
    assert fixed == 20 and log == 10  # 2N across the boundary vs exactly N
    assert log <= counter < fixed and bucket < fixed


def test_harness_parameters_are_configurable(capsys):
    assert harness.main(["--limit", "4", "--window", "1", "--burst", "1", "--silence", "1", "--duration", "6", "--offset", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "limit 4 per 1 s window" in out
    assert len([line for line in out.splitlines() if line[:6].strip().isdigit()]) == 6
