from ddtree_jax.cli import main

main()
