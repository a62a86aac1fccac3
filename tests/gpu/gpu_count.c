/* Prints how many CUDA devices this machine has (0 without a driver or device), for the GPU
 * shell tests to decide whether to run or skip. */
#include <stdio.h>

#include <cuda_runtime_api.h>

int main(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        printf("0\n");
        fprintf(stderr, "cudaGetDeviceCount: %s\n", cudaGetErrorString(e));
        return 0;
    }
    printf("%d\n", n);
    return 0;
}
