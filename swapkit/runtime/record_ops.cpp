// A swap record's two torch calls per saved tensor in C++, built into the module of runtime.native_save
// (swapkit.runtime.native) and given to the steps of a session with the C++ hooks: a keeper emptied at its
// release, a saved view rebuilt at its restore (Note [A record's torch calls in C++] in swapkit.runtime.records).
#include <torch/extension.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/variable.h>

#include <vector>

namespace swapkit {

namespace {

// records.empty_keeper: ``keeper.set_()``, its version counter put back as it was, also when set_ fails (Note
// [Version keepers] in swapkit.runtime.records).
void empty_keeper(at::Tensor keeper) {
  c10::VariableVersion counter = torch::autograd::impl::version_counter(keeper);  // shares the counter
  const int64_t version = counter.current_version();
  try {
    keeper.set_();
  } catch (...) {
    counter.set_version(version);
    throw;
  }
  counter.set_version(version);
}

// records.view_on: the view ``meta`` (dtype, size, stride, storage_offset, conj, neg) describes, on ``storage``
// from byte ``at``. ``empties`` is the Python's cache of empty tensors per dtype: not needed here.
at::Tensor view_on(py::handle storage, int64_t at, py::tuple meta, py::handle /*empties*/) {
  if (!THPStorage_Check(storage.ptr()) || meta.size() != 6 || !THPDtype_Check(meta[0].ptr()))
    throw py::type_error("swapkit view_on: expected a storage and (dtype, size, stride, offset, conj, neg)");
  c10::Storage bytes = THPStorage_Unpack(storage.ptr());
  const at::ScalarType dtype = reinterpret_cast<THPDtype*>(meta[0].ptr())->scalar_type;
  const auto size = meta[1].cast<std::vector<int64_t>>();
  const auto stride = meta[2].cast<std::vector<int64_t>>();
  const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(at % itemsize == 0, "swapkit view_on: byte ", at, " is not a multiple of the element size ", itemsize);
  const int64_t offset = meta[3].cast<int64_t>() + at / itemsize;
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype).device(bytes.device()));
  out.set_(bytes, offset, size, stride);
  if (meta[5].cast<bool>()) out = at::_neg_view(out);
  return meta[4].cast<bool>() ? out.conj() : out;
}

}  // namespace

void bind_record_ops(py::module_& m) {
  m.def("empty_keeper", &empty_keeper, "records.empty_keeper in C++");
  m.def("view_on", &view_on, "records.view_on in C++");
}

}  // namespace swapkit
