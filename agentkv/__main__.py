from agentkv.cli import main

main()
