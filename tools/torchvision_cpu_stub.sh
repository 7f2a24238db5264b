#!/bin/bash
# Make PyPI's (CUDA) torchvision 0.28.0 wheel importable with CPU-only torch 2.13.0+cpu,
# as measured in shared/notes/vllm-cpu-probe: there is no CPU build of torchvision on PyPI.
#  - stub libc10_cuda.so / libtorch_cuda.so providing the c10::cuda symbols torchvision references
#  - libcudart.so.13 -> bundled libcudart (torchvision.libs)
#  - patch _C.so RPATH so it finds them.
set -e
SP=${1:?usage: torchvision_cpu_stub.sh SITE_PACKAGES}
PATCHELF=${PATCHELF:-patchelf}
TVL=$SP/torchvision.libs
WORK=$(mktemp -d)
trap "rm -rf $WORK" EXIT
cat > $WORK/tv_c10_cuda_stub.c <<'EOC'
/* dummy definitions: never called on CPU code paths */
void* _ZN3c104cuda20CUDACachingAllocator9allocatorE = 0;
#define F(n) long n(void) { return 0; }
F(_ZN2at4cuda26getCurrentDevicePropertiesEv)
F(_ZN3c104cuda12device_countEv)
F(_ZN3c104cuda14ExchangeDeviceEa)
F(_ZN3c104cuda14MaybeSetDeviceEa)
F(_ZN3c104cuda14current_deviceEv)
F(_ZN3c104cuda17getStreamFromPoolEba)
F(_ZN3c104cuda17getStreamFromPoolEia)
F(_ZN3c104cuda20getCurrentCUDAStreamEa)
F(_ZN3c104cuda20getDefaultCUDAStreamEa)
F(_ZN3c104cuda20setCurrentCUDAStreamENS0_10CUDAStreamE)
F(_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb)
F(_ZN3c104cuda9GetDeviceEPa)
F(_ZN3c104cuda9SetDeviceEab)
F(_ZNK3c104cuda10CUDAStream11synchronizeEv)
F(_ZNK3c104cuda10CUDAStream5queryEv)
F(_ZNK3c104cuda10CUDAStream6streamEv)
EOC
gcc -shared -fPIC -O1 -Wl,-soname,libc10_cuda.so -o $TVL/libc10_cuda.so $WORK/tv_c10_cuda_stub.c
echo "" > $WORK/tv_empty.c
gcc -shared -fPIC -Wl,-soname,libtorch_cuda.so -o $TVL/libtorch_cuda.so $WORK/tv_empty.c
CUDART=$(ls $TVL/libcudart.*.so.13 | head -1)
ln -sf $(basename $CUDART) $TVL/libcudart.so.13
$PATCHELF --set-rpath '$ORIGIN:$ORIGIN/../torchvision.libs' $SP/torchvision/_C.so
