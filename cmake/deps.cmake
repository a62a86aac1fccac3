# The system libraries and programs the build needs, each with the Debian 12 package that
# provides it, so that a missing one fails the configure with what to apt-get install
# (scripts/install-deps.sh installs them all) instead of pkg-config's "Package 'grpc' ... not
# found". Included by the top-level CMakeLists.txt after find_package(PkgConfig).

set(PSHARD_DEPS_HINT "or run scripts/install-deps.sh, which installs every package the build \
and the tests need")

# pshard_require_modules(PREFIX DEBIAN_PACKAGE MODULE...): pkg_check_modules(PREFIX
# IMPORTED_TARGET MODULE...), or a fatal error naming DEBIAN_PACKAGE. A macro, so that the
# PREFIX_* variables and the PkgConfig::PREFIX target land in the caller's scope.
macro(pshard_require_modules prefix package)
  pkg_check_modules(${prefix} QUIET IMPORTED_TARGET ${ARGN})
  if(NOT ${prefix}_FOUND)
    message(FATAL_ERROR "pshard: pkg-config found no ${ARGN}; on Debian: "
                        "sudo apt-get install ${package} (${PSHARD_DEPS_HINT})")
  endif()
endmacro()

# pshard_require_program(VAR PROGRAM DEBIAN_PACKAGE): find_program(VAR PROGRAM), or a fatal
# error naming DEBIAN_PACKAGE.
macro(pshard_require_program var program package)
  find_program(${var} ${program})
  if(NOT ${var})
    message(FATAL_ERROR "pshard: no ${program} on PATH; on Debian: "
                        "sudo apt-get install ${package} (${PSHARD_DEPS_HINT})")
  endif()
endmacro()
