"""Inductor's C++ kernels compiled with the GCC flags that keep them correct (``lmfunc.compiler.cpp_flags``)."""

import pytest
import torch
from torch._inductor import cpp_builder
from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
from torch._inductor.cpu_vec_isa import pick_vec_isa

from lmfunc.compiler.cpp_flags import gcc_flags_for_correct_kernels


def _command_line() -> list[str]:
    options = CppTorchOptions(vec_isa=pick_vec_isa(), warning_all=False)
    return CppBuilder("probe", ["probe.cpp"], options, "/tmp").get_command_line().split()


def test_gcc_gets_no_ipa_cp_clone_only_while_lmfunc_compiles():
    """The flag is in Inductor's compile command (which also keys its compiled kernels) while the
    context holds, for GCC only, and gone afterwards."""
    if not cpp_builder._is_gcc(cpp_builder.get_cpp_compiler()):
        pytest.skip(f"Inductor's C++ compiler is not GCC ({cpp_builder.get_cpp_compiler()}): no flag to add")
    assert "-fno-ipa-cp-clone" not in _command_line()
    with gcc_flags_for_correct_kernels():
        assert "-fno-ipa-cp-clone" in _command_line() and "-O3" in _command_line()
    assert "-fno-ipa-cp-clone" not in _command_line()


TIED_GRADIENT_KERNEL = r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const at::BFloat16* in_ptr0,
                       const float* in_ptr1,
                       const float* in_ptr2,
                       const at::BFloat16* in_ptr3,
                       const float* in_ptr4,
                       float* out_ptr0)
{
    std::atomic<int> inductor_cpu_integer_div_error{0};
    inductor_cpu_integer_div_error_flag = &inductor_cpu_integer_div_error;
    #pragma omp parallel
    {
        int tid = omp_get_thread_num();
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(128L); x0+=static_cast<int64_t>(TILEL))
            {
                for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(64L); x1+=static_cast<int64_t>(TILEL))
                {
                    {
                        if(C10_LIKELY(x0 >= static_cast<int64_t>(0) && x0 < static_cast<int64_t>(128L) && x1 >= static_cast<int64_t>(0) && x1 < static_cast<int64_t>(64L)))
                        {
                            alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp0[TILE*TILE];
                            transpose_mxn<at::BFloat16,static_cast<int64_t>(TILE),static_cast<int64_t>(TILE),false>(in_ptr0 + static_cast<int64_t>(x0 + 128L*x1), static_cast<int64_t>(128L), tmp0, static_cast<int64_t>(TILE));
                            alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp16[TILE*TILE];
                            transpose_mxn<at::BFloat16,static_cast<int64_t>(TILE),static_cast<int64_t>(TILE),false>(in_ptr3 + static_cast<int64_t>(x0 + 128L*x1), static_cast<int64_t>(128L), tmp16, static_cast<int64_t>(TILE));
                            for (long x0_inner = 0; x0_inner < static_cast<int64_t>(TILE); x0_inner++)
                            {
                                auto tmp1 = at::vec::Vectorized<at::BFloat16>::loadu(tmp0 + static_cast<int64_t>(TILEL*x0_inner), static_cast<int64_t>(TILE));
                                auto tmp3 = in_ptr1[static_cast<int64_t>(0L)];
                                auto tmp12 = at::vec::VectorizedN<float,2>::loadu(in_ptr2 + static_cast<int64_t>(x1 + 64L*x0 + 64L*x0_inner), static_cast<int64_t>(TILE));
                                auto tmp17 = at::vec::Vectorized<at::BFloat16>::loadu(tmp16 + static_cast<int64_t>(TILEL*x0_inner), static_cast<int64_t>(TILE));
                                auto tmp20 = at::vec::VectorizedN<float,2>::loadu(in_ptr4 + static_cast<int64_t>(x1 + 64L*x0 + 64L*x0_inner), static_cast<int64_t>(TILE));
                                auto tmp2 = at::vec::convert<float,2,at::BFloat16,1>(tmp1);
                                auto tmp4 = static_cast<float>(1.0);
                                auto tmp5 = max_propagate_nan(tmp3, tmp4);
                                auto tmp6 = tmp4 / tmp5;
                                auto tmp7 = float(tmp6 * tmp4);
                                auto tmp8 = tmp7 / tmp7;
                                auto tmp9 = c10::convert<float>(tmp8);
                                auto tmp10 = at::vec::VectorizedN<float,2>(tmp9);
                                auto tmp11 = tmp2 * tmp10;
                                auto tmp13 = (tmp12);
                                auto tmp14 = tmp11 + tmp13;
                                auto tmp15 = (tmp14);
                                auto tmp18 = at::vec::convert<float,2,at::BFloat16,1>(tmp17);
                                auto tmp19 = tmp18 * tmp10;
                                auto tmp21 = (tmp20);
                                auto tmp22 = tmp19 + tmp21;
                                auto tmp23 = (tmp22);
                                auto tmp24 = tmp15 + tmp23;
                                tmp24.store(out_ptr0 + static_cast<int64_t>(x1 + 64L*x0 + 64L*x0_inner));
                            }
                        }
                    }
                }
            }
        }
    }
    inductor_cpu_integer_div_error_flag = nullptr;
    inductor_cpu_throw_if_integer_div_error(inductor_cpu_integer_div_error);
}
'''
"""The kernel Inductor generated on AVX-512 for the TINY bf16 step with one output-layer chunk per
microbatch (torch 2.13), with its tile width as ``TILE``: the two microbatches' bf16 output-weight
gradients ``[h, V]`` are read in transposed ``TILE x TILE`` tiles, widened, scaled by
``1 / max(in_ptr1[0], 1)`` over itself, added to the fp32 token-embedding gradients ``[V, h]`` and
summed into the tied weight's fp32 gradient. ``TILE`` is one ``Vectorized<BFloat16>``: 32 lanes on
AVX-512 (the kernel as generated), 16 on AVX2 (where Inductor tiles the same loop by 16)."""

ISA_BIT_WIDTHS = {"avx2": 256, "avx512": 512}
"""The x86 vector ISAs Inductor picks from, by the width it compiles kernels for."""


@pytest.mark.parametrize("isa_name", sorted(ISA_BIT_WIDTHS))
def test_the_tied_gradient_kernel_that_gave_nan_is_exact(isa_name):
    """Compiled as lmfunc compiles kernels for each vector ISA this CPU runs, the kernel above gives
    the transposed sum exactly. Without ``-fno-ipa-cp-clone``, GCC 12.2 on an AVX-512 machine got
    7,900 of its 8,192 outputs wrong (NaN among them), which is how the compiled bf16 step returned
    NaN gradients. The AVX-512 case needs an AVX-512 CPU; the AVX2 case runs on both kinds."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    bit_width = ISA_BIT_WIDTHS[isa_name]
    runnable = {isa.bit_width() for isa in valid_vec_isa_list()}
    if bit_width not in runnable:
        pytest.skip(f"this CPU runs no {isa_name} kernels (Inductor's ISAs here: "
                    f"{[str(isa) for isa in valid_vec_isa_list()]}); the case runs on a CPU that has them")
    tile = bit_width // 16
    source = TIED_GRADIENT_KERNEL.replace("TILE", str(tile))
    arg_types = ["const at::BFloat16*", "const float*", "const float*", "const at::BFloat16*", "const float*", "float*"]
    with gcc_flags_for_correct_kernels(), inductor_config.patch({"cpp.simdlen": bit_width}):
        kernel = CppPythonBindingsCodeCache.load_pybinding(arg_types, source)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad_a, grad_b = (torch.randn(64, 128, generator=generator).bfloat16() for _ in range(2))
        embed_a, embed_b = (torch.randn(128, 64, generator=generator) for _ in range(2))
        out = torch.full((128, 64), float("nan"))
        kernel(grad_a, torch.tensor([1.0]), embed_a, grad_b, embed_b, out)
        assert torch.equal(out, (grad_a.float().t() + embed_a) + (grad_b.float().t() + embed_b))
