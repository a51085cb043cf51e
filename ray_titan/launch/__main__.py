from ray_titan.launch.torchrun import main

main()
