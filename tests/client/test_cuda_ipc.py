"""``deconv_client.cuda_ipc`` without a GPU: its ctypes calls against a small C library with the signatures of the
CUDA runtime's and driver's calls it makes (compiled here; skipped without a C compiler), so that what crosses
into C is checked: the 64-byte handle whole in both directions (zero bytes included) and by value, the device set
for each call and put back, a failed call's error taken out of the runtime's last-error slot, the driver's errors.
The real libraries run on the GPU: tests/service/test_cuda_shm.py."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
from deconv_client import cuda_ipc

FAKE = r"""
#include <stdint.h>
#include <stddef.h>
typedef struct { unsigned char reserved[64]; } handle_t;
static int current = 0, last_error = 0;
static unsigned char memory[4096];

static void pattern(unsigned char *out) { for (int i = 0; i < 64; i++) out[i] = (i % 3 == 0) ? 0 : (unsigned char)i; }
int cudaGetDevice(int *d) { *d = current; return 0; }
int cudaSetDevice(int d) { if (d > 1) { last_error = 101; return 101; } current = d; return 0; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
const char *cudaGetErrorString(int e) { return e == 400 ? "invalid resource handle" : "invalid device ordinal"; }
int cudaIpcGetMemHandle(handle_t *h, void *p) {
  if (p != memory) { last_error = 1; return 1; }
  pattern(h->reserved);
  return 0;
}
int cudaIpcOpenMemHandle(void **p, handle_t h, unsigned int flags) {
  unsigned char want[64];
  pattern(want);
  for (int i = 0; i < 64; i++) if (h.reserved[i] != want[i]) { last_error = 400; return 400; }
  if (flags != 1 || current != 1) { last_error = 1; return 1; }
  *p = memory;
  return 0;
}
int cudaIpcCloseMemHandle(void *p) { return p == memory ? 0 : 400; }
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t p) {
  if (p < (uint64_t)(uintptr_t)memory || p >= (uint64_t)(uintptr_t)memory + sizeof memory) return 500;
  *base = (uint64_t)(uintptr_t)memory;
  *size = sizeof memory;
  return 0;
}
int cuGetErrorString(int e, const char **s) { *s = "named symbol not found"; return 0; }
int fake_device(void) { return current; }
int fake_last_error(void) { return last_error; }
void *fake_memory(void) { return memory; }
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> tuple[cuda_ipc.Cuda, ctypes.CDLL]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA library")
    root: Path = tmp_path_factory.mktemp("fakecuda")
    (root / "fake.c").write_text(FAKE)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(root / "libfakecuda.so"), str(root / "fake.c")],
                   check=True)
    lib = ctypes.CDLL(str(root / "libfakecuda.so"))
    lib.fake_memory.restype = ctypes.c_void_p
    return cuda_ipc.Cuda(runtime=str(root / "libfakecuda.so"), driver=str(root / "libfakecuda.so")), lib


def test_handles_cross_whole_and_the_device_is_put_back(fake) -> None:
    cuda, lib = fake
    memory = lib.fake_memory()
    expected = bytes(0 if i % 3 == 0 else i for i in range(64))
    assert lib.cudaSetDevice(0) == 0
    base, size = cuda.allocation(1, memory + 100)
    assert (base, size) == (memory, 4096)
    handle = cuda.get_handle(1, base)
    assert handle == expected  # every byte, the zero bytes too
    assert lib.fake_device() == 0  # the calling thread's device put back
    assert cuda.open(1, handle) == memory  # the handle passed by value, whole; on the device asked for
    assert lib.fake_device() == 0
    cuda.close(1, memory)


def test_errors_name_the_call_and_leave_nothing_behind(fake) -> None:
    cuda, lib = fake
    memory = lib.fake_memory()
    with pytest.raises(cuda_ipc.CudaError, match=r"cudaIpcOpenMemHandle: invalid resource handle \(CUDA error 400\)"):
        cuda.open(1, bytes(64))
    assert lib.fake_last_error() == 0  # taken out of the last-error slot
    with pytest.raises(cuda_ipc.CudaError, match=r"cudaSetDevice\(7\): invalid device ordinal"):
        cuda.get_handle(7, memory)
    assert lib.fake_last_error() == 0
    with pytest.raises(cuda_ipc.CudaError, match="cuMemGetAddressRange: named symbol not found"):
        cuda.allocation(0, 16)
    with pytest.raises(cuda_ipc.CudaError, match="64 bytes, got 8"):
        cuda.open(1, bytes(8))
    with pytest.raises(cuda_ipc.CudaError, match="cudaIpcCloseMemHandle"):
        cuda.close(1, memory + 1)


def test_a_missing_library_is_a_cuda_error(tmp_path: Path) -> None:
    with pytest.raises(cuda_ipc.CudaError, match="no CUDA runtime library"):
        cuda_ipc.Cuda(runtime=str(tmp_path / "libcudart.so.404"))


def test_the_handle_struct_keeps_every_byte() -> None:
    data = bytes([0, 1, 0, 2] * 16)
    assert cuda_ipc.from_handle(cuda_ipc.to_handle(data)) == data
    with pytest.raises(cuda_ipc.CudaError, match="64 bytes"):
        cuda_ipc.to_handle(data[:63])
