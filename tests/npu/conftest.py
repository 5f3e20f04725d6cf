import pytest


@pytest.fixture(autouse=True, scope="module")
def _remove_standin_modules_afterwards():
    """The stand-in's fake torch_npu/torchair must not leak into other tests (transformers probes
    find_spec('torch_npu')); each test module that needs them calls standin.install() again."""
    yield
    from graphgen.npu.standin import fakes as standin

    standin.uninstall()
