"""The runtime function table: how generated code reaches BLAS and the thread runtime.

Generated code never links against OpenBLAS or libgomp. Each generated module holds
an internal global ``@tgc.fntable = [N x ptr]`` and exports an init function
``void <init>(ptr table)`` that copies N function pointers from the caller's array
into it. The runtime calls init once after loading (JIT engine or ``dlopen``ed
``.so`` alike), then the entry points. The table layout, one 8-byte pointer each:

    index  field                LLVM function type
    0      sgemm                void (i32, i32, i32, i64, i64, i64, float,
                                      ptr, i64, ptr, i64, float, ptr, i64)  (ILP64 CBLAS)
    1      dgemm                the same with double
    2      gomp_parallel        void (ptr fn, ptr data, i32 num_threads, i32 flags)
    3      omp_get_thread_num   i32 ()
    4      omp_get_num_threads  i32 ()
    5      blas_get_threads     i32 ()            (openblas_get_num_threads)
    6      blas_set_threads     void (i32)        (openblas_set_num_threads)
    7      omp_get_max_threads  i32 ()            (the team size of a region)
    8      cgemm                void (i32, i32, i32, i64, i64, i64, ptr alpha,
                                      ptr, i64, ptr, i64, ptr beta, ptr, i64)  (ILP64 CBLAS)
    9      zgemm                the same (complex double)
    10     gomp_barrier         void ()           (GOMP_barrier: the barriers inside a region
                                                   that runs several kernels, regions.py)

The module copies the pointers, so the Python-side array may be freed after init.
Only fields a module calls need be non-null, but the array always has all N slots.
The runtime builds the array with
``make_table({**blas.gemm_addresses(), **parallel.gomp_addresses()})``.
(`blas.gemm_addresses` gives the two thread-count entries too.)
"""

import ctypes

import llvmlite.ir as ir

from tgc.backends.cpu import blas

FIELDS = ('sgemm', 'dgemm', 'gomp_parallel', 'omp_get_thread_num', 'omp_get_num_threads',
          'blas_get_threads', 'blas_set_threads', 'omp_get_max_threads', 'cgemm', 'zgemm', 'gomp_barrier')
GLOBAL = 'tgc.fntable'


def field_type(name: str) -> ir.FunctionType:
    """The LLVM function type of table entry ``name``."""
    i32, ptr = ir.IntType(32), ir.PointerType()
    types = {
        'sgemm': blas.gemm_type(ir.FloatType()),
        'dgemm': blas.gemm_type(ir.DoubleType()),
        'gomp_parallel': ir.FunctionType(ir.VoidType(), [ptr, ptr, i32, i32]),
        'omp_get_thread_num': ir.FunctionType(i32, []),
        'omp_get_num_threads': ir.FunctionType(i32, []),
        'blas_get_threads': ir.FunctionType(i32, []),
        'blas_set_threads': ir.FunctionType(ir.VoidType(), [i32]),
        'omp_get_max_threads': ir.FunctionType(i32, []),
        'cgemm': blas.complex_gemm_type(),
        'zgemm': blas.complex_gemm_type(),
        'gomp_barrier': ir.FunctionType(ir.VoidType(), []),
    }
    return types[name]


def make_table(addresses: dict[str, int]) -> ctypes.Array:
    """The ctypes array to pass to init; missing fields are null."""
    return (ctypes.c_void_p * len(FIELDS))(*(addresses.get(f) for f in FIELDS))


def _table_global(module: ir.Module) -> ir.GlobalVariable:
    existing = module.globals.get(GLOBAL)
    if existing is not None:
        return existing
    g = ir.GlobalVariable(module, ir.ArrayType(ir.PointerType(), len(FIELDS)), GLOBAL)
    g.linkage = 'internal'
    g.initializer = ir.Constant(g.value_type, None)
    return g


def declare_table(module: ir.Module) -> ir.GlobalVariable:
    """Declare the table that another module of the same program defines (its
    definition then needs a linkage other than internal)."""
    g = ir.GlobalVariable(module, ir.ArrayType(ir.PointerType(), len(FIELDS)), GLOBAL)
    g.linkage = 'external'
    return g


def _slot(builder: ir.IRBuilder, table: ir.GlobalVariable, index: int):
    i32 = ir.IntType(32)
    return builder.gep(table, [i32(0), i32(index)], inbounds=True)


def define_init(module: ir.Module, name: str = 'tgc_init') -> ir.Function:
    """Define the exported ``void name(ptr table)`` that fills ``@tgc.fntable``."""
    g = _table_global(module)
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.PointerType()]), name)
    b = ir.IRBuilder(fn.append_basic_block('entry'))
    src = fn.args[0]
    for i in range(len(FIELDS)):
        src_slot = b.gep(src, [ir.IntType(64)(i)], source_etype=ir.PointerType())
        b.store(b.load(src_slot, typ=ir.PointerType()), _slot(b, g, i))
    b.ret_void()
    return fn


def call(builder: ir.IRBuilder, name: str, args) -> ir.Instruction:
    """Emit a call through table entry ``name`` (loads the pointer at the call)."""
    fnty = field_type(name)
    g = _table_global(builder.module)
    target = builder.load(_slot(builder, g, FIELDS.index(name)), typ=fnty.as_pointer())
    return builder.call(target, args)


def is_set(builder: ir.IRBuilder, name: str) -> ir.Instruction:
    """i1: table entry ``name`` is not null (the runtime gave it)."""
    g = _table_global(builder.module)
    ptr = builder.load(_slot(builder, g, FIELDS.index(name)), typ=ir.PointerType())
    return builder.icmp_unsigned('!=', ptr, ir.Constant(ir.PointerType(), None))
