// Ways (k) and (l) of benchmarks/microbench.py: a keep's and a coalesced swap's bookkeeping in C++ (Note [What
// a save path in C++ pays] in microbench.py). Built on first use by torch.utils.cpp_extension.load; a
// benchmark, not part of swapkit.
//
// Way (k). A Hooks object holds one storage index. Its pack hook ticks a clock, tests that the tensor is plain,
// looks its StorageImpl up in the index, and for a storage it has no record of (or one written in place
// since) makes a record: the storage's bytes, counted in the held bytes and their peak, and the parameter
// and device tests of a new storage. Every save gets a handle: a detached keeper, the version it had, its
// record. The unpack hook checks the version (an in-place write raises) and returns the keeper. A record
// lives while a handle holds it; the last handle's end takes its bytes off and its index entry out.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

struct Hooks;

struct Record {
  Hooks* owner;
  c10::Storage storage;  // the index's key stays this storage while the record lives
  int64_t nbytes;
  int64_t version;
  int64_t handles;
};

struct Hooks {
  PyObject_HEAD
  std::unordered_map<c10::StorageImpl*, Record*>* index;
  std::unordered_set<c10::StorageImpl*>* parameters;  // empty here: the lookup is what a keep pays
  int64_t clock, bytes, peak, records, unusual;
};

struct Handle {
  PyObject_HEAD
  PyObject* keeper;
  PyObject* hooks;  // keeps the index alive for the record's release
  int64_t version;
  Record* record;
};

PyTypeObject HooksType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_save.Hooks"};
PyTypeObject HandleType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_save.Handle"};

// Both ways' test of a tensor they index by storage (as (i)'s and (j)'s, which also take an exact Parameter).
bool plain(PyObject* object, const at::Tensor& tensor) {
  return THPVariable_CheckExact(object) && tensor.layout() == c10::kStrided && !tensor.is_nested() &&
         !tensor.is_quantized();
}

// The parameter and device tests a new storage needs; their answers only count (``unusual``), so that the
// compiler keeps them.
template <typename H>
void test_new_storage(H* hooks, c10::StorageImpl* key, const at::Tensor& tensor) {
  bool parameter = hooks->parameters->count(key) > 0 || tensor.is_view();
  hooks->unusual += parameter || tensor.device().type() != c10::kCPU;
}

// A handle of type H for ``record``, which the caller counted for it (``handles``): with ``keeper`` null (its
// wrap failed) or the handle not made, the record is released again, so none is left indexed without a handle.
template <typename H, typename R>
H* new_handle(PyTypeObject* type, PyObject* hooks, PyObject* keeper, int64_t version, R* record,
              void (*release_record)(R*)) {
  auto* handle = keeper == nullptr ? nullptr : PyObject_New(H, type);
  if (handle == nullptr) {
    Py_XDECREF(keeper);
    if (record != nullptr) release_record(record);
    return nullptr;
  }
  Py_INCREF(hooks);
  handle->keeper = keeper;
  handle->hooks = hooks;
  handle->version = version;
  handle->record = record;
  return handle;
}

void release(Record* record) {
  if (--record->handles > 0) return;
  Hooks* hooks = record->owner;
  hooks->bytes -= record->nbytes;
  auto found = hooks->index->find(record->storage.unsafeGetStorageImpl());
  if (found != hooks->index->end() && found->second == record) hooks->index->erase(found);
  delete record;
}

void Handle_dealloc(PyObject* self) {
  auto* handle = reinterpret_cast<Handle*>(self);
  Py_XDECREF(handle->keeper);
  if (handle->record != nullptr) release(handle->record);
  Py_XDECREF(handle->hooks);
  Py_TYPE(self)->tp_free(self);
}

// Way (k)'s handle of ``record`` (counted for it by record_of): new_handle's contract.
PyObject* make_handle(PyObject* hooks, const at::Tensor& tensor, int64_t version, Record* record) {
  PyObject* keeper = nullptr;
  try {
    keeper = THPVariable_Wrap(tensor.detach());
  } catch (...) {
    if (record != nullptr) release(record);
    throw;
  }
  return reinterpret_cast<PyObject*>(new_handle<Handle>(&HandleType, hooks, keeper, version, record, release));
}

Record* record_of(Hooks* hooks, const at::Tensor& tensor, int64_t version) {
  c10::StorageImpl* key = tensor.storage().unsafeGetStorageImpl();
  auto found = hooks->index->find(key);
  if (found != hooks->index->end() && found->second->version == version) {
    found->second->handles++;  // for the handle about to be made
    return found->second;
  }
  test_new_storage(hooks, key, tensor);
  auto* record = new Record{hooks, tensor.storage(), static_cast<int64_t>(key->nbytes()), version, 1};
  (*hooks->index)[key] = record;  // replaces a record written in place since: its handles keep it
  hooks->bytes += record->nbytes;
  hooks->peak = std::max(hooks->peak, hooks->bytes);
  hooks->records++;
  return record;
}

PyObject* pack(PyObject* self, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* hooks = reinterpret_cast<Hooks*>(self);
  hooks->clock++;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  int64_t version = tensor._version();
  return make_handle(self, tensor, version, plain(object, tensor) ? record_of(hooks, tensor, version) : nullptr);
  END_HANDLE_TH_ERRORS
}

// Both unpack hooks' checks: ``object`` is a handle of ``type`` (one that ``hook`` made) and its keeper was not
// written in place since the save. The handle, or null with the Python error set.
template <typename H>
H* checked_handle(PyObject* object, PyTypeObject* type, const char* hook) {
  if (Py_TYPE(object) != type) {
    PyErr_Format(PyExc_TypeError, "native_save: not a handle of its %s", hook);
    return nullptr;
  }
  auto* handle = reinterpret_cast<H*>(object);
  if (THPVariable_Unpack(handle->keeper)._version() != handle->version) {
    PyErr_SetString(PyExc_RuntimeError, "native_save: a saved tensor was modified in place");
    return nullptr;
  }
  return handle;
}

PyObject* unpack(PyObject*, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* handle = checked_handle<Handle>(object, &HandleType, "pack hook");
  if (handle == nullptr) return nullptr;
  Py_INCREF(handle->keeper);
  return handle->keeper;
  END_HANDLE_TH_ERRORS
}

PyMethodDef pack_def = {"pack", pack, METH_O, "the pack hook"};
PyMethodDef unpack_def = {"unpack", unpack, METH_O, "the unpack hook"};

void Hooks_dealloc(PyObject* self) {
  auto* hooks = reinterpret_cast<Hooks*>(self);
  delete hooks->index;  // no record is left: each handle holds this object
  delete hooks->parameters;
  Py_TYPE(self)->tp_free(self);
}

void ready(PyTypeObject* type, Py_ssize_t size, destructor dealloc) {
  if (type->tp_flags & Py_TPFLAGS_READY) return;
  type->tp_basicsize = size;
  type->tp_dealloc = dealloc;
  type->tp_flags = Py_TPFLAGS_DEFAULT;
  if (PyType_Ready(type) < 0) throw py::error_already_set();
}


// Way (l), as way (j) of microbench.py in C++: the keep's lookups and tests, and a new storage joins the open
// batch; every SWAP_BATCH new storages the batch is copied to one host region as (j) and swapkit's engines
// copy it (a flat byte view per storage, one slot per storage at a multiple of ALIGN bytes, one
// _foreach_copy_, which checks every size) and its keepers let go of the storages (set_(), version put
// back). A storage saved again once its batch was copied gets an empty keeper at once, unless it was written
// in place since: then it is a new storage, as in swapkit's step. At unpack, the version check; the first
// unpack of a copied batch copies the region back (one clone), and each handle's view is rebuilt on it
// (dtype, size, stride, offset, conj and neg bits). CPU only, as (j).
constexpr size_t SWAP_BATCH = 8;
constexpr int64_t ALIGN = 16;

struct Batch {
  std::vector<c10::Storage> storages;  // until the copy
  std::vector<std::pair<int64_t, int64_t>> slots;  // (offset, bytes) in the region, per storage
  std::vector<at::Tensor> keepers;  // emptied at the copy
  int64_t bytes = 0;
  at::Tensor region;  // the host copy, once made
  at::Tensor restored;  // the copy back, at the batch's first unpack
};

struct SwapHooks;

struct SwapRecord {
  SwapHooks* owner;
  c10::StorageImpl* key;  // its index entry, unless a record of a new storage at that address replaced it
  std::shared_ptr<Batch> batch;
  int64_t offset;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // keeps the StorageImpl's address from being reused
  int64_t version;
  int64_t handles;
};

struct SwapHooks {
  PyObject_HEAD
  std::unordered_map<c10::StorageImpl*, SwapRecord*>* index;
  std::unordered_set<c10::StorageImpl*>* parameters;
  std::shared_ptr<Batch>* open;
  int64_t clock, copies, records, unusual;
};

struct View {
  at::ScalarType dtype;
  std::vector<int64_t> size, stride;
  int64_t offset;
  bool conj, neg;
};

struct SwapHandle {
  PyObject_HEAD
  PyObject* keeper;
  PyObject* hooks;
  int64_t version;
  SwapRecord* record;
  View* view;
};

PyTypeObject SwapHooksType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_save.SwapHooks"};
PyTypeObject SwapHandleType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_save.SwapHandle"};

void empty_keeper(at::Tensor& keeper) {
  int64_t version = keeper._version();
  keeper.set_();
  c10::VariableVersion counter = torch::autograd::impl::version_counter(keeper);
  counter.set_version(version);  // the counter is shared with the saved tensor: put back what set_() bumped
}

void copy_out(Batch& batch) {
  at::Tensor region = at::empty({batch.bytes}, at::TensorOptions().dtype(at::kByte));
  std::vector<int64_t> sizes;  // each storage's bytes, then its slot's padding
  for (const auto& slot : batch.slots) {
    sizes.push_back(slot.second);
    sizes.push_back((slot.second + ALIGN - 1) / ALIGN * ALIGN - slot.second);
  }
  std::vector<at::Tensor> parts = region.split_with_sizes(sizes), slots, storages;
  for (size_t i = 0; i < batch.storages.size(); ++i) {
    slots.push_back(parts[2 * i]);
    storages.push_back(at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(batch.storages[i]));
  }
  at::_foreach_copy_(slots, storages);  // raises (the batch stays open, nothing emptied) for a resized storage
  batch.region = region;
  for (auto& keeper : batch.keepers) empty_keeper(keeper);
  batch.storages.clear();
  batch.keepers.clear();
}

void release_swap(SwapRecord* record) {
  if (--record->handles > 0) return;
  auto* index = record->owner->index;
  auto found = index->find(record->key);
  if (found != index->end() && found->second == record) index->erase(found);
  delete record;
}

void SwapHandle_dealloc(PyObject* self) {
  auto* handle = reinterpret_cast<SwapHandle*>(self);
  Py_XDECREF(handle->keeper);
  if (handle->record != nullptr) release_swap(handle->record);
  delete handle->view;
  Py_XDECREF(handle->hooks);
  Py_TYPE(self)->tp_free(self);
}

SwapRecord* swap_record_of(SwapHooks* hooks, const at::Tensor& tensor) {
  c10::StorageImpl* key = tensor.storage().unsafeGetStorageImpl();
  auto found = hooks->index->find(key);
  if (found != hooks->index->end() && found->second->version == tensor._version()) {
    found->second->handles++;  // for the handle about to be made
    return found->second;
  }
  test_new_storage(hooks, key, tensor);
  Batch& batch = **hooks->open;
  int64_t nbytes = static_cast<int64_t>(key->nbytes());
  auto* record = new SwapRecord{hooks, key, *hooks->open, batch.bytes,
                                c10::weak_intrusive_ptr<c10::StorageImpl>(tensor.storage().getWeakStorageImpl()),
                                tensor._version(), 1};
  (*hooks->index)[key] = record;
  batch.storages.push_back(tensor.storage());
  batch.slots.emplace_back(batch.bytes, nbytes);
  batch.bytes += (nbytes + ALIGN - 1) / ALIGN * ALIGN;
  hooks->records++;
  return record;
}

// Way (l)'s save of ``tensor`` into ``record`` (counted for its handle by the caller): the view to rebuild,
// and the keeper either joins the open batch (copied once it is full) or is emptied at once.
std::unique_ptr<View> join(SwapHooks* hooks, SwapRecord* record, const at::Tensor& tensor, at::Tensor& keeper) {
  auto view = std::make_unique<View>(View{tensor.scalar_type(), tensor.sizes().vec(), tensor.strides().vec(),
                                          tensor.storage_offset(), tensor.is_conj(), tensor.is_neg()});
  Batch& batch = *record->batch;
  if (batch.region.defined()) {  // saved again after its batch was copied: its bytes are on the host already
    empty_keeper(keeper);
    return view;
  }
  batch.keepers.push_back(keeper);
  if (batch.storages.size() >= SWAP_BATCH) {
    copy_out(batch);
    hooks->copies++;
    *hooks->open = std::make_shared<Batch>();
  }
  return view;
}

PyObject* swap_pack(PyObject* self, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* hooks = reinterpret_cast<SwapHooks*>(self);
  hooks->clock++;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  int64_t version = tensor._version();
  SwapRecord* record = plain(object, tensor) ? swap_record_of(hooks, tensor) : nullptr;  // counted for its handle
  std::unique_ptr<View> view;
  PyObject* wrapped = nullptr;
  try {
    at::Tensor keeper = tensor.detach();
    if (record != nullptr) view = join(hooks, record, tensor, keeper);
    wrapped = THPVariable_Wrap(std::move(keeper));
  } catch (...) {
    if (record != nullptr) release_swap(record);
    throw;
  }
  auto* handle = new_handle<SwapHandle>(&SwapHandleType, self, wrapped, version, record, release_swap);
  if (handle == nullptr) return nullptr;
  handle->view = view.release();
  return reinterpret_cast<PyObject*>(handle);
  END_HANDLE_TH_ERRORS
}

PyObject* swap_unpack(PyObject*, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* handle = checked_handle<SwapHandle>(object, &SwapHandleType, "swap pack hook");
  if (handle == nullptr) return nullptr;
  if (handle->record == nullptr || !handle->record->batch->region.defined()) {  // kept, or never copied
    Py_INCREF(handle->keeper);
    return handle->keeper;
  }
  Batch& batch = *handle->record->batch;
  if (!batch.restored.defined()) batch.restored = batch.region.clone();  // one copy back per batch
  const View& view = *handle->view;
  int64_t itemsize = static_cast<int64_t>(c10::elementSize(view.dtype));
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(view.dtype));
  out.set_(batch.restored.storage(), handle->record->offset / itemsize + view.offset, view.size, view.stride);
  if (view.neg) out = at::_neg_view(out);
  if (view.conj) out = out.conj();
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef swap_pack_def = {"pack", swap_pack, METH_O, "way (l)'s pack hook"};
PyMethodDef swap_unpack_def = {"unpack", swap_unpack, METH_O, "way (l)'s unpack hook"};

void SwapHooks_dealloc(PyObject* self) {
  auto* hooks = reinterpret_cast<SwapHooks*>(self);
  delete hooks->index;  // no record is left: each handle holds this object
  delete hooks->parameters;
  delete hooks->open;
  Py_TYPE(self)->tp_free(self);
}

}  // namespace

// (pack, unpack, counters): the hooks of a new index, and a function reading its counters.
py::tuple make_hooks() {
  ready(&HooksType, sizeof(Hooks), Hooks_dealloc);
  ready(&HandleType, sizeof(Handle), Handle_dealloc);
  auto* hooks = PyObject_New(Hooks, &HooksType);
  if (hooks == nullptr) throw py::error_already_set();
  hooks->index = new std::unordered_map<c10::StorageImpl*, Record*>();
  hooks->parameters = new std::unordered_set<c10::StorageImpl*>();
  hooks->clock = hooks->bytes = hooks->peak = hooks->records = hooks->unusual = 0;
  auto self = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(hooks));
  auto pack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&pack_def, self.ptr()));
  auto unpack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&unpack_def, self.ptr()));
  py::cpp_function counters([self]() {
    auto* state = reinterpret_cast<Hooks*>(self.ptr());
    return py::dict(py::arg("saves") = state->clock, py::arg("bytes") = state->bytes,
                    py::arg("peak") = state->peak, py::arg("records") = state->records,
                    py::arg("indexed") = state->index->size());
  });
  return py::make_tuple(pack_fn, unpack_fn, counters);
}

// (pack, unpack, counters) of way (l): the hooks of a new index and open batch, and a function reading its counters.
py::tuple make_swap_hooks() {
  ready(&SwapHooksType, sizeof(SwapHooks), SwapHooks_dealloc);
  ready(&SwapHandleType, sizeof(SwapHandle), SwapHandle_dealloc);
  auto* hooks = PyObject_New(SwapHooks, &SwapHooksType);
  if (hooks == nullptr) throw py::error_already_set();
  hooks->index = new std::unordered_map<c10::StorageImpl*, SwapRecord*>();
  hooks->parameters = new std::unordered_set<c10::StorageImpl*>();
  hooks->open = new std::shared_ptr<Batch>(std::make_shared<Batch>());
  hooks->clock = hooks->copies = hooks->records = hooks->unusual = 0;
  auto self = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(hooks));
  auto pack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&swap_pack_def, self.ptr()));
  auto unpack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&swap_unpack_def, self.ptr()));
  py::cpp_function counters([self]() {
    auto* state = reinterpret_cast<SwapHooks*>(self.ptr());
    return py::dict(py::arg("saves") = state->clock, py::arg("copies") = state->copies,
                    py::arg("records") = state->records, py::arg("indexed") = state->index->size(),
                    py::arg("open") = (*state->open)->storages.size());
  });
  return py::make_tuple(pack_fn, unpack_fn, counters);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("make_hooks", &make_hooks, "way (k)'s pack and unpack hooks over a new storage index, and its counters");
  module.def("make_swap_hooks", &make_swap_hooks, "way (l)'s pack and unpack hooks, and its counters");
}
