"""deconv kernels: an exact, trainable CUDA ``conv_transpose2d`` and a drop-in ``ConvTranspose2d``.

    import kernels
    y = kernels.conv_transpose2d(x, w, b, stride=2, padding=1)    # F.conv_transpose2d's signature
    layer = kernels.ConvTranspose2d(64, 32, 4, stride=2, padding=1)  # nn.ConvTranspose2d's signature
    model = kernels.convert(model)                                  # swap every nn.ConvTranspose2d in place
    kernels.tuning.enable()                                         # measured kernel choice per problem
    kernels.refresh_weights(model)                                  # after writes PyTorch cannot see (.data)

CUDA tensors run the kernels in ``kernels/csrc`` (built on first use, see ``kernels.build``); CPU tensors run
PyTorch's reference implementation. The call is the operator ``torch.ops.deconv.conv_transpose2d`` to
torch.compile, torch.export and CUDA graphs (``kernels.op``).
"""

from kernels import tuning
from kernels.functional import ConvTranspose2dArgumentError, conv_transpose2d, output_size
from kernels.module import ConvTranspose2d, convert
from kernels.op import refresh_weights

__all__ = ["ConvTranspose2d", "ConvTranspose2dArgumentError", "conv_transpose2d", "convert", "output_size",
           "refresh_weights", "tuning"]
