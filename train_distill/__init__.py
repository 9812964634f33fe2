"""Training on the same model code: data, trainer, distillation losses, Outlier-Safe Pre-Training.

Empty until the training issue lands; the package exists so the distribution's layout is fixed.
"""
