# seeds/003 line 346 (SFT), dotted by hand; the input template is passed separately by the test
--data.max_len 4096 --data.dataset Open-Orca/OpenOrca --data.input_key question --data.output_key response
--train.batch_size 256 --train.micro_batch_size 2 --data.max_samples 500000
--model.model_name_or_path meta-llama/Meta-Llama-3-8B --ckpt.output_dir ./checkpoint/llama3-8b-sft --ckpt.save_steps -1
--logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 2 --train.max_epochs 1 --ds.packing_samples
--ds.param_dtype bf16 --adam.lr 5e-6 --model.gradient_checkpointing_enable --logger.wandb.key {wandb_token}
