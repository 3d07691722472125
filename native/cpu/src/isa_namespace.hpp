// Internal kernel headers are compiled once per ISA (portable, avx2, avx512),
// each translation unit with its own -m flags.  Everything they define lives
// in graphattn::<GRAPHATTN_ISA_NS> so that the linker can never merge an
// AVX-512 build of an inline function into the portable path.
#pragma once

#ifndef GRAPHATTN_ISA_NS
#error "define GRAPHATTN_ISA_NS before including graphattn kernel headers"
#endif
