"""Triton's system shared-memory extension: regions of POSIX shared-memory objects that a client
created (shm_open, as tritonclient.utils.shared_memory and perf_analyzer do) and registered by name,
read for inputs and written for outputs instead of sending tensors in the request and response.

One registry per server, shared by the HTTP and gRPC fronts (a region registered over one is used over
the other, as in Triton). It is used from the server's event loop only, so it takes no lock: looking a
region up and copying its bytes happen with no await in between.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.triton import dtypes
from tokenmill.triton.scheduling import InferError

SHM_DIR = Path("/dev/shm")
# Objects a client must not be able to map: the server's own (the KV cache's `tokenmill-kv-*` regions,
# which an output written there would corrupt) and POSIX semaphores, which glibc keeps in /dev/shm as
# `sem.<name>`. A prefix, as Triton reserves its Python backend's regions.
RESERVED_PREFIXES = ("tokenmill", "sem.")
MAX_REGIONS = 4096  # each region holds a mapping (and its descriptor) until unregistered
CUDA_NEEDS_GPU = "CUDA shared memory needs a GPU; this server has none"
CLIENT_SHM_DISABLED = (
    "client shared memory is disabled: start the server with --allow-client-shm to enable it"
)


class ShmError(InferError):
    """An InferError with Triton's error kind, which the gRPC front turns into its status code
    (ALREADY_EXISTS has no HTTP code of its own: Triton answers it with 400)."""

    def __init__(self, status: int, message: str, kind: str = "INVALID_ARG") -> None:
        super().__init__(status, message)
        self.kind = kind


def object_path(name: str, key: str, shm_dir: Path = SHM_DIR) -> Path:
    """Where shm_open(key) finds its object: `/dev/shm/<key without its leading slashes>`. A key is a
    name, not a path: nothing after the leading slashes may lead out of the directory."""
    base = key.lstrip("/")
    if not base or "/" in base or "\0" in base or base in (".", ".."):
        raise ShmError(
            400,
            f"cannot register shared memory region {name!r}: invalid shm key {key!r} "
            "(a POSIX shared-memory name: '/name', with no other '/')",
        )
    if base.startswith(RESERVED_PREFIXES):
        raise ShmError(
            400,
            f"cannot register shared memory region {name!r} with key {key!r}: keys starting with "
            f"{' or '.join(repr(p) for p in RESERVED_PREFIXES)} are reserved",
        )
    return shm_dir / base


class Region:
    """A registered region: bytes [offset, offset + byte_size) of a shared-memory object, mapped
    read/write. The mapping starts at the page boundary at or below `offset` (mmap's offsets must be
    multiples of the allocation granularity; Triton's fail otherwise)."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, shm_dir: Path = SHM_DIR) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        path = object_path(name, key, shm_dir)
        try:
            # O_NOFOLLOW: a symlink planted in /dev/shm would lead anywhere the server may write.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ShmError(400, f"Unable to open shared memory region: {key!r} ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(
                    400, f"Unable to open shared memory region: {key!r} (not a shared-memory object)"
                )
            if byte_size <= 0 or offset + byte_size > st.st_size:
                raise ShmError(
                    400,
                    f"failed to register shared memory region {name!r}: invalid args: offset {offset} + "
                    f"byte_size {byte_size} must lie within {key!r}, which has {st.st_size} bytes",
                )
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            self._base = offset - start
            try:
                self._map: mmap.mmap | None = mmap.mmap(fd, self._base + byte_size, offset=start)
            except (OSError, ValueError) as e:
                raise ShmError(400, f"failed to register shared memory region {name!r}: {e}") from None
        finally:
            os.close(fd)  # the mapping keeps its own descriptor (mmap.size() reads the object's size)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check(self, offset: int, size: int) -> None:
        """That [offset, offset + size) lies within the region (and its object), as a request names it."""
        self._span(offset, size)

    def read(self, offset: int, size: int) -> bytes:
        start = self._span(offset, size)
        return self._mapped()[start : start + size]

    def write(self, offset: int, data: bytes) -> None:
        start = self._span(offset, len(data))
        self._mapped()[start : start + len(data)] = data

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise ShmError(400, f"shared memory region {self.name!r} was unregistered while the request ran")
        return self._map

    def _span(self, offset: int, size: int) -> int:
        """Where [offset, offset + size) of the region starts in the mapping, once it is known to lie
        within the region and within the object as it is now."""
        if offset >= self.byte_size and size > 0:
            raise ShmError(
                400,
                f"Invalid offset for shared memory region: {self.name!r} "
                f"({offset} is past its {self.byte_size} bytes)",
            )
        if offset + size > self.byte_size:
            raise ShmError(
                400,
                f"Invalid offset + byte size for shared memory region: {self.name!r} (offset {offset} + "
                f"{size} bytes is past its {self.byte_size} bytes)",
            )
        # Touching a mapped page past the object's end raises SIGBUS and kills the server: a client that
        # shrank the object (ftruncate) after registering it gets an error instead.
        end_in_object = self.offset + offset + size
        if self._mapped().size() < end_in_object:
            raise ShmError(
                400,
                f"shared memory region {self.name!r}: its object {self.key!r} shrank below "
                f"{end_in_object} bytes after it was registered",
            )
        return self._base + offset


class Registry:
    """`allow_client`: whether clients may register regions at all. Whoever may call the API can make
    the server read and write any object in /dev/shm that the server's user may open, so a server on a
    shared host may refuse (as Triton's --allow-client-shm=false does: register and unregister fail,
    status answers)."""

    def __init__(self, shm_dir: Path = SHM_DIR, allow_client: bool = True) -> None:
        self.shm_dir, self.allow_client = shm_dir, allow_client
        self.regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._allowed()
        if not name:
            raise ShmError(400, "'region name' is necessary to register system shared memory region")
        if name in self.regions:
            raise ShmError(400, f"shared memory region {name!r} already in manager", "ALREADY_EXISTS")
        if len(self.regions) >= MAX_REGIONS:
            raise ShmError(
                400,
                f"cannot register shared memory region {name!r}: {MAX_REGIONS} regions are registered",
            )
        self.regions[name] = Region(name, key, offset, byte_size, self.shm_dir)

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """All regions' status, or the one named (Triton's NOT_FOUND when there is none)."""
        if not name:
            return [r.status() for r in self.regions.values()]
        return [self.get(name, f"Unable to find system shared memory region: {name!r}").status()]

    def get(self, name: str, missing: str | None = None) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise ShmError(404, missing or f"Unable to find shared memory region: {name!r}", "NOT_FOUND")
        return region

    def unregister(self, name: str = "") -> None:
        """One region, or all of them; a name that is not registered is no error (as in Triton)."""
        self._allowed()
        for n in [name] if name else list(self.regions):
            region = self.regions.pop(n, None)
            if region is not None:
                region.close()

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def _allowed(self) -> None:
        if not self.allow_client:
            raise ShmError(400, CLIENT_SHM_DISABLED, "UNSUPPORTED")


def registry(repo: Any) -> Registry:
    """The server's registry, hung on its ModelRepository (both fronts hold the repository); clients
    may register regions unless the repository says `allow_client_shm = False`."""
    reg = getattr(repo, "shm", None)
    if reg is None:
        reg = repo.shm = Registry(allow_client=getattr(repo, "allow_client_shm", True))
    return reg


# --- tensors in shared memory ------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor is, or goes: `byte_size` bytes at `offset` of a registered region."""

    region: Region
    offset: int
    byte_size: int


def tensor_ref(reg: Registry, params: Mapping[str, Any], what: str) -> TensorRef | None:
    """The shared-memory place an input's or requested output's parameters name, or None when they name
    none. `what` names the tensor in errors ("input 'X'")."""
    region = params.get("shared_memory_region")
    size, offset = params.get("shared_memory_byte_size"), params.get("shared_memory_offset", 0)
    if region is None:
        for k in ("shared_memory_byte_size", "shared_memory_offset"):
            if k in params:
                raise ShmError(400, f"{what}: {k!r} can not be specified without 'shared_memory_region'")
        return None
    if not isinstance(region, str):
        raise ShmError(400, f"{what}: 'shared_memory_region' must be a string")
    if size is None:
        raise ShmError(400, f"{what}: 'shared_memory_byte_size' is required with 'shared_memory_region'")
    for k, v in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ShmError(400, f"{what}: {k!r} must be a non-negative integer")
    ref = TensorRef(reg.get(region), offset, size)
    ref.region.check(offset, size)
    return ref


def read_input(ref: TensorRef, datatype: str, shape: list[int], what: str) -> np.ndarray:
    """The input's tensor, copied out of its region: a client may write the region again as soon as the
    response arrives, and the model must not see that."""
    blob = ref.region.read(ref.offset, ref.byte_size)
    try:
        return dtypes.from_binary(blob, datatype, shape)
    except ValueError as e:
        raise ShmError(400, f"{what}: {ref.byte_size} bytes of shared memory: {e}") from None


def write_outputs(refs: Mapping[str, TensorRef], out: Mapping[str, np.ndarray]) -> None:
    """Each output with a place into it; all sizes are checked before anything is written."""
    blobs = {name: dtypes.to_binary(out[name]) for name in refs if name in out}
    for name, blob in blobs.items():
        if len(blob) > refs[name].byte_size:
            raise ShmError(
                400,
                f"shared memory size specified with the request for output {name!r} "
                f"({refs[name].byte_size} bytes) should be at least {len(blob)} bytes to hold the results",
            )
    for name, blob in blobs.items():
        refs[name].region.write(refs[name].offset, blob)
