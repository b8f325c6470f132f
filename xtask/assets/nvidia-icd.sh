# Sourced by the GPU bundle's scripts (with $logs set): NVIDIA's OpenCL platform through an ICD
# vendors directory of their own, $icd, since the node's loader may list only PoCL and ocl-icd
# ignores OCL_ICD_FILENAMES. Empty where the library is absent: the OpenCL rows then skip.
icd="$logs/icd"; mkdir -p "$icd"
for l in /usr/local/nvidia/lib64/libnvidia-opencl.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1; do
  [ -e "$l" ] && echo "$l" > "$icd/nvidia.icd" && break
done
