"""edge: a cold-start runtime for Jetson-class edge devices.

Importing the package is cheap: nothing here touches llama.cpp, TensorRT or the HTTP stack.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
