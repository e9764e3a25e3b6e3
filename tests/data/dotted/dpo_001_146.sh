# seeds/001 line 146 (DPO), dotted by hand
--ckpt.output_dir ./output/llama3-8b-dpo --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
--train.batch_size 256 --train.micro_batch_size 2 --model.model_name_or_path meta-llama/Meta-Llama-3-8B
--ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 5e-7 --model.beta 0.1
--data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --data.apply_chat_template --data.chosen_key chosen
--data.rejected_key rejected --ds.attn_implementation flash_attention_2 --model.gradient_checkpointing_enable
