from gpudiag.launch import main

main()
