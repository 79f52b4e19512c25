"""The CLI's progress line: shown from the first update (also when stderr is a pipe or a file), with an ETA; a line
per tenth of the work when stderr is not a terminal, one line redrawn in place when it is (or when forced)."""

from h3_blackwell.cli import progress as P


def _fake_clock(monkeypatch, times):
    it = iter(times)
    monkeypatch.setattr(P.time, "perf_counter", lambda: next(it))


def test_first_update_shows_at_once_with_an_eta(monkeypatch, capsys):
    _fake_clock(monkeypatch, [100.0, 104.0])  # construction, then the first step after 4 s
    P.Progress("sampling")(1, 5)
    err = capsys.readouterr().err
    assert err == "sampling [######........................] 1/5  elapsed 0:04  ETA 0:16\n"


def test_not_a_terminal_writes_a_line_per_tenth_and_the_last(monkeypatch, capsys):
    _fake_clock(monkeypatch, [0.0] + [0.1 * i for i in range(1, 41)])
    p = P.Progress("sampling")
    for i in range(1, 41):
        p(i, 40)
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split()[2] for ln in lines] == [f"{i}/40" for i in (1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 40)]
    assert "ETA" not in lines[-1] and all("ETA" in ln for ln in lines[:-1]) and "\r" not in "".join(lines)


def test_a_slow_step_is_reported_after_log_every_s(monkeypatch, capsys):
    _fake_clock(monkeypatch, [0.0, 1.0, 1.0 + P.LOG_EVERY_S + 0.5])
    p = P.Progress("sampling")
    p(1, 100)
    p(2, 100)  # one hundredth more, but LOG_EVERY_S later
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_forced_bar_redraws_in_place_and_ends_its_line(monkeypatch, capsys):
    _fake_clock(monkeypatch, [0.0, 1.0, 2.0])
    p = P.Progress("quantize", force=True)
    p(1, 2)
    assert P._open_line
    p(2, 2)
    err = capsys.readouterr().err
    assert err.startswith("\rquantize [") and err.count("\r") == 2 and err.endswith("\n") and not P._open_line


def test_unknown_total_counts_without_a_bar(monkeypatch, capsys):
    _fake_clock(monkeypatch, [0.0, 65.0])
    P.Progress("quantize")(3, 0)
    assert capsys.readouterr().err == "quantize 3  elapsed 1:05\n"
    assert P.clock(3723) == "1:02:03"
