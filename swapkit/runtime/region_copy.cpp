// The CPU thread engine's copy of a coalesced batch in C++, built into the module of runtime.native_save
// (swapkit.runtime.native) and bound there as ``copy_region``.
#include <torch/extension.h>
#include <torch/csrc/Storage.h>

#include <cstring>
#include <vector>

namespace swapkit {

// The thread engine's copy of a coalesced batch into its host region, with the interpreter lock released for
// the checks and the copies (Note [Region copies without the interpreter lock] in swapkit.engine.thread).
// ``sources``: the batch's ``(storage, offset, nbytes, address)``, storages on the CPU; ``region``: a contiguous
// CPU uint8 tensor holding every slot. Checks that each storage still has the size and address it was saved
// with, copies each into its slot, checks again (Note [Storages another component may resize] in
// swapkit.runtime.records). Returns -1, or the index of the first changed storage (the caller raises).
int64_t copy_region(const at::Tensor& region, py::list sources) {
  struct Source {
    c10::Storage storage;  // holds the StorageImpl for the copy, as the Python views did
    int64_t offset, nbytes;
    uintptr_t address;
  };
  if (!region.is_cpu() || region.scalar_type() != at::kByte || !region.is_contiguous())
    throw py::value_error("swapkit copy_region: the region must be a contiguous CPU uint8 tensor");
  std::vector<Source> items;
  items.reserve(py::len(sources));
  for (py::handle item : sources) {
    auto source = item.cast<py::tuple>();
    if (source.size() != 4 || !THPStorage_Check(source[0].ptr()))
      throw py::type_error("swapkit copy_region: each source must be (storage, offset, nbytes, address)");
    Source entry{THPStorage_Unpack(source[0].ptr()), source[1].cast<int64_t>(), source[2].cast<int64_t>(),
                 source[3].cast<uintptr_t>()};
    if (entry.storage.device_type() != c10::kCPU || entry.offset < 0 || entry.nbytes < 0 ||
        entry.offset > region.numel() || entry.nbytes > region.numel() - entry.offset)
      throw py::value_error("swapkit copy_region: a source is not on the CPU or does not fit its slot of the region");
    items.push_back(std::move(entry));
  }
  uint8_t* base = region.data_ptr<uint8_t>();
  py::gil_scoped_release unlocked;
  auto changed = [&items]() -> int64_t {
    for (size_t i = 0; i < items.size(); i++) {
      const c10::Storage& storage = items[i].storage;
      if (static_cast<int64_t>(storage.nbytes()) != items[i].nbytes ||
          reinterpret_cast<uintptr_t>(storage.data()) != items[i].address)
        return static_cast<int64_t>(i);
    }
    return -1;
  };
  int64_t first = changed();
  if (first >= 0) return first;
  for (const Source& item : items)
    if (item.nbytes > 0) std::memcpy(base + item.offset, item.storage.data(), static_cast<size_t>(item.nbytes));
  return changed();
}

}  // namespace swapkit
