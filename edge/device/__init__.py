"""What this machine is: identity (Jetson module, SoC, SM, CUDA, TensorRT, CPU), the CUDA driver boundary, and its memory."""
