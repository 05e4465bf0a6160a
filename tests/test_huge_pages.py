"""The weights a decode step streams whole sit in memory advised for transparent huge pages."""

import gc
import mmap

import pytest
import torch

from rqbatcher.workers.model.huge_pages import huge_page_buffer
from rqbatcher.workers.model.int8_linear import Int8Linear, quantize_linears
from tests.test_int8_linear import load, on_native_here

ADVICE = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`, from /proc/self/smaps ("hg": advised MADV_HUGEPAGE)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_buffer_is_a_writable_uint8_tensor_that_keeps_its_memory():
    buffer = huge_page_buffer(3 << 20)
    assert buffer.dtype == torch.uint8 and buffer.shape == (3 << 20,) and buffer.device.type == "cpu"
    buffer[::4096] = 7
    gc.collect()  # nothing but the tensor holds the mapping
    assert int(buffer[::4096].sum()) == 7 * len(range(0, 3 << 20, 4096))
    assert huge_page_buffer(0).numel() == 0


@ADVICE
def test_the_buffer_is_advised_for_huge_pages():
    assert "hg" in vm_flags(huge_page_buffer(4 << 20).data_ptr())


@ADVICE
@pytest.mark.parametrize("on_native", [False, pytest.param(True, marks=on_native_here)])
def test_a_cpu_models_int8_weights_are_advised_for_huge_pages(tiny_model_dir, on_native):
    model = load(tiny_model_dir("llama"))
    quantize_linears(model, on_native=on_native)
    weights = {m.qweight.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, Int8Linear)}
    assert len(weights) == 1 and "hg" in vm_flags(weights.pop())
