// The C entry point of an emulated kernel, appended after the kernel source: emu_launch runs the kernel
// named by EMU_KERNEL on a grid, with its arguments passed as an array of pointers to their values (the
// convention of cuLaunchKernel). Returns 0, or an error code with a message in `err`.
#pragma once

namespace emu {
inline void** g_args = nullptr;

template <class... A, size_t... I>
void call_unpacked(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
void call_packed(void (*kernel)(A...), void** args) {
  call_unpacked(kernel, args, std::index_sequence_for<A...>{});
}
inline void kernel_thunk() { call_packed(&EMU_KERNEL, g_args); }
}  // namespace emu

extern "C" int emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned nthreads, unsigned smem_bytes, void** args,
                          char* err, int errlen) {
  emu::g_args = args;
  emu::g_thunk = emu::kernel_thunk;
  return emu::run_grid(gx, gy, gz, nthreads, smem_bytes, err, errlen);
}
