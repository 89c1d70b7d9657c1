# XLA FFI headers come from the jaxlib in the build environment (pinned in pyproject's build requires).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import jax.ffi, jaxlib; print(jax.ffi.include_dir()); print(jaxlib.__version__)"
  OUTPUT_VARIABLE _xla_out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_VARIABLE _err)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "jax_engram: cannot import jax in the build env (${_err}).\n"
                      "Install jax/jaxlib there (pyproject pins them) or build with --no-build-isolation.")
endif()
string(REPLACE "\n" ";" _xla_lines "${_xla_out}")
list(GET _xla_lines 0 XLA_FFI_INCLUDE_DIR)
list(GET _xla_lines 1 JAX_ENGRAM_BUILD_JAXLIB)
if(NOT EXISTS "${XLA_FFI_INCLUDE_DIR}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR "jax_engram: no xla/ffi/api/ffi.h under ${XLA_FFI_INCLUDE_DIR}")
endif()
file(STRINGS "${XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h" _maj REGEX "#define XLA_FFI_API_MAJOR")
file(STRINGS "${XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h" _min REGEX "#define XLA_FFI_API_MINOR")
string(REGEX MATCH "[0-9]+" JAX_ENGRAM_FFI_MAJOR "${_maj}")
string(REGEX MATCH "[0-9]+" JAX_ENGRAM_FFI_MINOR "${_min}")
message(STATUS "jax_engram: XLA FFI headers of jaxlib ${JAX_ENGRAM_BUILD_JAXLIB} "
               "(FFI API ${JAX_ENGRAM_FFI_MAJOR}.${JAX_ENGRAM_FFI_MINOR}) at ${XLA_FFI_INCLUDE_DIR}")
