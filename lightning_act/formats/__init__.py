"""The compressed formats, each specified by its pure-torch reference (``*_reference``): what a codec stores, bit
for bit. The CUDA kernels (:mod:`lightning_act.cuda`) reproduce these references; the codecs
(:mod:`lightning_act.codecs`) choose between the two. Nothing here imports the codecs, the kernels or the engine.
"""
