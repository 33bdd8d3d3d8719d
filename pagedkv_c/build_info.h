/* Compile-time facts about how the core was built, for pagedkv_c._build_info.
 *
 * OpenMP is reported from the compiler's own _OPENMP macro (set by -fopenmp
 * or /openmp), so the answer is what the compiler did, not what the build
 * script asked for; asking for OpenMP and not getting it is a build error.
 */
#ifndef PAGEDKV_BUILD_INFO_H
#define PAGEDKV_BUILD_INFO_H

#if defined(PAGEDKV_HAVE_OPENMP) && PAGEDKV_HAVE_OPENMP && !defined(_OPENMP)
#error "PAGEDKV_HAVE_OPENMP=1 but the compiler did not enable OpenMP"
#endif

#ifdef _OPENMP
#include <omp.h>
#define PKV_OPENMP 1
#define PKV_OPENMP_VERSION _OPENMP  /* yyyymm date of the OpenMP specification implemented */
static inline int pkv_openmp_max_threads(void) { return omp_get_max_threads(); }
#else
#define PKV_OPENMP 0
#define PKV_OPENMP_VERSION 0
static inline int pkv_openmp_max_threads(void) { return 1; }
#endif

#endif
