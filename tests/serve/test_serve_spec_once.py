"""``graphgen serve`` loads its spec once (issue 31 item 2; review 3's C5: the arguments' check, the
rank count and ``open_engine`` each loaded it): the spec ``check_args`` loaded is the one
``open_engine`` runs, the run's overrides applied to it. In this interpreter, up to the point where the
server would listen (``run_server`` replaced), every `load_spec` call counted."""
from __future__ import annotations

import pytest

from graphgen.modelspec import loader
from graphgen.serve import cli as serve_cli
from support.servers import SPEC


def _serve_until_listening(monkeypatch, *argv) -> tuple[int, list, dict]:
    calls, seen, real = [], {}, loader.load_spec

    def counting(path, *a, **kw):
        calls.append(str(path))
        return real(path, *a, **kw)

    def no_server(app, *a, **kw):  # the engine is up: note it, let it go
        st = app.state.serving
        seen.update(spec=st.engine.engine.spec, name=st.engine.model_name)
        st.engine.shutdown()
        return 0

    monkeypatch.setattr(loader, "load_spec", counting)
    monkeypatch.setattr(serve_cli, "run_server", no_server)
    rc = serve_cli.main(["--spec", str(SPEC), "--port", "0", "--num-blocks", "16", *argv])
    return rc, calls, seen


def test_serve_loads_the_spec_once_and_applies_the_overrides_to_it(ckpt, monkeypatch):
    rc, calls, seen = _serve_until_listening(monkeypatch, "--weights", str(ckpt), "--write", "off")
    assert rc == 0 and calls == [str(SPEC)]
    assert seen["spec"].pool.write == "off" and seen["name"] == seen["spec"].name  # the override, on that spec
    # the control: open_engine given the file (as serve called it before) is a second load the count sees
    # (it stops at the missing weights, after loading the spec: no second engine is built)
    from graphgen.runtime import open_engine

    with pytest.raises(ValueError, match="weights are required"):
        open_engine(str(SPEC), None)
    assert calls == [str(SPEC), str(SPEC)]
