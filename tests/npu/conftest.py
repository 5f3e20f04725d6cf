import pytest


@pytest.fixture(autouse=True, scope="module")
def _remove_standin_modules_afterwards():
    """The stand-in's fake torch_npu/torchair must not leak into other tests (transformers probes
    find_spec('torch_npu')); each test module that needs them calls standin.install() again."""
    yield
    from graphgen.npu import standin

    standin.uninstall()


@pytest.fixture(autouse=True)
def _weights_in_the_spec_dtype(monkeypatch):
    """The hardware-shaped specs are bfloat16: weights are cast to the KV dtype (the routers keep
    float32, as transformers keeps them), as a bf16 checkpoint would load.  ``npu.inputs.random_weights``
    builds float32 (coordinator: give it the spec dtype, then drop this shim).  Also installs the
    stand-in kernel for the un-absorbed MLA form (``npu.kernels_extra``)."""
    torch = pytest.importorskip("torch")
    from graphgen.families import FAMILIES
    from graphgen.npu import inputs, kernels_extra

    orig = inputs.random_weights

    def random_weights(spec, *args, **kwargs):
        W = orig(spec, *args, **kwargs)
        keep = FAMILIES[spec.family].fp32_suffixes
        dtype = getattr(torch, spec.kv_cache.dtype)
        return {k: (w if k.endswith(keep) else w.to(dtype)) for k, w in W.items()}

    monkeypatch.setattr(inputs, "random_weights", random_weights)
    kernels_extra.install()
    yield
